"""Sampler: one token per sequence from the target's logits, with its log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling.grammar import mask_logits
from engine.sampling.logits_processing import (
    LogitsContext,
    apply_penalties,
    sample_from,
    target_probabilities,
    token_logprobs,
)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that did not ask for logprobs


def sample(
    logits: torch.Tensor,  # [N, vocab] float32, raw target logits
    contexts: list[LogitsContext],
    generators: list[torch.Generator | None],
    bitmasks: torch.Tensor | None = None,  # [N, words] int32 grammar masks; None: unconstrained
) -> SamplerOutput:
    """Log-probabilities are the raw target's; the grammar and every setting shape the choice."""
    params = [c.params for c in contexts]
    processed = logits
    if bitmasks is not None:
        processed = mask_logits(logits.clone(), bitmasks)
    if any(
        p.has_penalties or p.logit_bias or c.num_output_tokens < p.min_tokens
        for p, c in zip(params, contexts)
    ):
        processed = apply_penalties(processed if bitmasks is not None else logits.clone(), contexts)
    if all(p.greedy for p in params):
        tokens = processed.argmax(dim=-1)  # [N]
    else:
        probs = target_probabilities(processed, params)  # [N, vocab]; greedy rows are one-hot
        tokens = sample_from(probs, [None if p.greedy else g for p, g in zip(params, generators)])
    return SamplerOutput(tokens.tolist(), _logprobs(logits, tokens, params))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params) -> list[TokenLogprob | None]:
    wanted = [p.logprobs for p in params]
    if all(w is None for w in wanted):
        return [None] * len(params)
    num_top = max(w or 0 for w in wanted)
    chosen, top_values, top_ids = token_logprobs(logits, tokens, num_top)
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    result: list[TokenLogprob | None] = []
    for row, (token, w) in enumerate(zip(tokens.tolist(), wanted)):
        if w is None:
            result.append(None)
            continue
        top = tuple(zip(top_ids[row][:w], top_values[row][:w]))
        result.append(TokenLogprob(token, chosen[row], top))
    return result
