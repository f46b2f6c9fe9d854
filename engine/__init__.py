"""Aerie's engine: paged KV cache, continuous batching, sampling, and the LLM facade."""

from engine.config import EngineConfig
from engine.errors import (
    AerieError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AerieError",
    "CompletionOutput",
    "ContextLengthExceededError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedArchitectureError",
]
