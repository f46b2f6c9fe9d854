"""A client request and its sequences: the request's validated prompt and sampling settings, and
each of its n generated continuations (a Sequence) with its progress and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestMetrics
from engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.outputs import TokenLogprob
    from engine.sampling.detokenizer import IncrementalDetokenizer
    from engine.sampling.grammar import CompiledGrammar, GrammarMatcher


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not pass this (the context or max_tokens)
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    grammar: CompiledGrammar | None = None  # what every choice's output must match
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def num_pending_choices(self) -> int:
        """Choices not yet forked: the first sequence prefills the prompt once for all n."""
        return self.params.n - len(self.sequences)

    @property
    def finished(self) -> bool:
        return self.num_pending_choices == 0 and all(s.is_finished for s in self.sequences)


class SequenceStatus(enum.IntEnum):
    """Ordered so that `is_finished` is one comparison."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt, then output), how many have K/V cached, and the blocks holding them."""

    seq_id: int
    request: Request
    index: int  # which of the request's n choices
    token_ids: list[int]
    prompt_len: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None  # set for seeded requests: its own random stream
    grammar: GrammarMatcher | None = None  # constrained requests: the grammar after the output
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # With a draft head: positions whose head K/V is computed (None: no head), and the target
    # features of positions [num_head_computed_tokens, num_computed_tokens), in order, as the
    # passes brought them ([k, hidden] each; the drafter concatenates them when it needs them).
    num_head_computed_tokens: int | None = None
    pending_features: list[torch.Tensor] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_hashed_blocks: int = 0  # leading blocks already offered to the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""  # output text so far, cut at a stop string
    num_emitted_chars: int = 0  # text already handed out in deltas
    stop_reason: int | str | None = None
    num_emitted_tokens: int = 0  # output tokens already handed out in deltas
    num_emitted_logprobs: int = 0
    num_decode_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.prompt_len <= len(self.token_ids):
            raise ValueError("a sequence needs a non-empty prompt within its tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_final_kv_tokens(self) -> int:
        """Leading positions whose K/V is final in every layer (the target's and the head's)."""
        if self.num_head_computed_tokens is None:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, self.num_head_computed_tokens)

    def reset_computed(self, num_cached: int = 0) -> None:
        """Forget computed K/V beyond the first `num_cached` positions (preemption, cache hits)."""
        self.num_computed_tokens = num_cached
        if self.num_head_computed_tokens is not None:
            self.num_head_computed_tokens = num_cached
        self.pending_features = []

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling sharing this sequence's tokens and blocks (the caller adjusts ref counts)."""
        return Sequence(
            seq_id=seq_id,
            request=self.request,
            index=index,
            token_ids=list(self.token_ids),
            prompt_len=self.prompt_len,
            detokenizer=self.detokenizer.copy(),
            generator=generator,
            grammar=self.grammar.fork() if self.grammar else None,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_table=list(self.block_table),
            block_hashes=list(self.block_hashes),
            num_hashed_blocks=self.num_hashed_blocks,
            text=self.text,
            num_head_computed_tokens=self.num_head_computed_tokens,
            pending_features=list(self.pending_features),
        )
