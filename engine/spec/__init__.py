"""Speculation as the engine sees it: the drafter protocol, the draft-method entry point through
which drafting/ plugs in, and the budget that decides how much of a tree to verify."""
