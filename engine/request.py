"""Request: one client request, its validated prompt and sampling settings, and its n sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not pass this (the context or max_tokens)
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def num_pending_choices(self) -> int:
        """Choices not yet forked: the first sequence prefills the prompt once for all n."""
        return self.params.n - len(self.sequences)

    @property
    def finished(self) -> bool:
        return self.num_pending_choices == 0 and all(s.is_finished for s in self.sequences)
