"""Pure tensor helpers that turn target logits into the distribution a request samples from.

Order, as in vLLM: penalties, logit bias and the min_tokens ban act on raw logits; then temperature;
then top-k, top-p and min-p filter. Greedy rows become one-hot distributions, so one acceptance rule
serves greedy and sampled requests alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsContext:
    """What one row's logits are conditioned on: the request's settings and the tokens so far."""

    params: SamplingParams
    token_ids: list[int]  # prompt then output, up to the position being sampled
    prompt_len: int
    eos_token_ids: frozenset[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


def apply_penalties(logits: torch.Tensor, contexts: list[LogitsContext]) -> torch.Tensor:
    """Penalties, logit bias and the min_tokens ban, in place. logits: [N, vocab] float32."""
    for row, ctx in enumerate(contexts):
        params = ctx.params
        if params.has_penalties:
            _penalize_row(logits[row], ctx)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
            logits[row].index_add_(0, ids, bias.to(logits.dtype))
        if ctx.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids) | (
                set() if params.ignore_eos else ctx.eos_token_ids
            )
            if banned:
                logits[row, list(banned)] = float("-inf")
    return logits


def _penalize_row(row: torch.Tensor, ctx: LogitsContext) -> None:
    """Repetition penalty over prompt and output; presence and frequency over the output."""
    params, vocab = ctx.params, row.shape[0]
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(ctx.token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    output = ctx.token_ids[ctx.prompt_len :]
    if output and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=vocab).to(row.dtype)  # [vocab]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def target_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: [N, vocab] logits (penalised) -> [N, vocab] probs."""
    probs = torch.empty_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        one_hot = torch.zeros_like(logits[rows])
        one_hot.scatter_(1, logits[rows].argmax(-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs[rows] = _filtered_softmax(logits[rows], [params[i] for i in sampled])
    return probs


def _filtered_softmax(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [M, vocab] -> probs [M, vocab]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [M, 1]
        probs = torch.where(probs < threshold, 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf what top-k (k <= 0: off) and top-p (1: off) remove. logits: [M, vocab]."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [M, vocab]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [M, vocab], exclusive
    p = torch.tensor(top_p, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row [N] from probs [N, vocab] (rows need not sum to one), by inverting each
    row's cumulative distribution at one uniform draw.

    A row with its own generator draws only from it, so a seeded request samples the same tokens
    whatever else shares the batch. One draw per row (not one per vocabulary entry) keeps sampling
    a small part of a step even at large batches.
    """
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=probs.device)  # [N]
    uniforms.uniform_()
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = torch.rand(
                (), generator=generator, dtype=torch.float64, device=probs.device
            )
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [N, vocab]
    total = cdf[:, -1:]  # [N, 1]
    # Strictly below the total, so some entry of the cdf exceeds the point, and the first that does
    # belongs to a token of positive probability.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    points = torch.minimum(uniforms[:, None] * total, below_total)  # [N, 1]
    return torch.searchsorted(cdf, points, right=True).squeeze(-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw target distribution: the chosen tokens' [N], and the top
    `num_top` alternatives' values and ids [N, num_top]. logits: [N, vocab]; token_ids: [N]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_values, top_ids = (
        logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], token_ids[:, None][:, :0])
    )
    return chosen, top_values, top_ids
