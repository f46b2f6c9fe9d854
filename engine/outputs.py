"""What the engine hands back: per-choice outputs, per-request outputs and their metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of an emitted token under the target model, and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """One of a request's n choices. In a delta, text, token_ids and logprobs are the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_decode_steps: int = 0  # target passes that produced tokens after prefill
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Append a delta of the same request to this cumulative output."""
        by_index = {o.index: o for o in self.outputs}
        for new in delta.outputs:
            out = by_index.get(new.index)
            if out is None:
                out = CompletionOutput(index=new.index, logprobs=[] if new.logprobs else None)
                self.outputs.append(out)
                by_index[new.index] = out
            out.text += new.text
            out.token_ids.extend(new.token_ids)
            if new.logprobs:
                out.logprobs = (out.logprobs or []) + list(new.logprobs)
            out.finish_reason, out.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.metrics = delta.metrics
