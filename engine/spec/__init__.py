"""Speculation as the engine sees it: the drafter protocol, the draft-method entry point through
which drafting/ plugs in, and the policy that decides where to draft (the controller, per batch
size; the evidence, per request) and how much of a tree to verify (the budget)."""
