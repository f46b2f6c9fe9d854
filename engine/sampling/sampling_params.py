"""SamplingParams: how one request chooses its tokens and when it stops, validated on creation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral, Real

from engine.errors import InvalidRequestError
from engine.sampling.grammar import GrammarSpec

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM's names and meanings.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch those filters off.
    `logprobs` is the number of top alternatives to return per token (0: only the chosen token's),
    None returns none. `max_tokens` None means "until the context is full". `structured`: the
    grammar the output must match (JSON schema, regex, ...), None for free text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        self._check_types()
        # Accept the forms users pass (a single stop string, lists) and store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in (self.stop or ()) if s))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        self._validate()

    def _check_types(self) -> None:
        """Each field has its annotated type (bools are not numbers here), checked before any
        comparison: n=1.5 would otherwise pass `n >= 1`, and a string would raise TypeError."""
        for f in fields(self):
            value = getattr(self, f.name)
            # The annotations are strings (postponed evaluation): "int", "float | None", ...
            kind = f.type.removesuffix(" | None")
            if value is None and f.type.endswith(" | None"):
                continue
            if kind == "int":
                _check(_is_int(value), f"{f.name} must be an integer, got {value!r}", f.name)
            elif kind == "float":
                _check(
                    _is_finite(value), f"{f.name} must be a finite number, got {value!r}", f.name
                )
            elif kind == "bool":
                _check(
                    isinstance(value, bool), f"{f.name} must be a boolean, got {value!r}", f.name
                )
        stop = self.stop
        _check(
            stop is None
            or isinstance(stop, str)
            or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)),
            "stop must be a string or a list of strings",
            "stop",
        )
        ids = self.stop_token_ids
        _check(
            ids is None or (isinstance(ids, (list, tuple)) and all(map(_is_int, ids))),
            "stop_token_ids must be a list of integers",
            "stop_token_ids",
        )
        bias = self.logit_bias
        _check(
            bias is None
            or (
                isinstance(bias, Mapping)
                and all(_is_int(k) and _is_finite(v) for k, v in bias.items())
            ),
            "logit_bias must map token ids (integers) to numbers",
            "logit_bias",
        )

    def _validate(self) -> None:
        _check(self.n >= 1, "n must be at least 1", "n")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed must be a 64-bit signed integer",
            "seed",
        )
        _check(self.temperature >= 0, "temperature must be >= 0", "temperature")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]", "top_p")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]", "min_p")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty must be in [-2, 2]",
            "presence_penalty",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty must be in [-2, 2]",
            "frequency_penalty",
        )
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0", "repetition_penalty")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens must be at least 1",
            "max_tokens",
        )
        _check(self.min_tokens >= 0, "min_tokens must be >= 0", "min_tokens")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
            "min_tokens",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
            "logprobs",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be >= 0",
            "stop_token_ids",
        )
        _check(
            self.structured is None or isinstance(self.structured, GrammarSpec),
            "structured must be a GrammarSpec",
            "structured",
        )
        _check(
            self.structured is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured outputs (the grammar decides where "
            "the output ends)",
            "min_tokens",
        )
        if self.logit_bias:
            _check(
                all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
                "logit_bias",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
