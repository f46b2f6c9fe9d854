"""EngineConfig: every engine setting in one frozen, validated object."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from engine.errors import AerieError
from engine.execution.layers.flash_attention import BACKENDS as ATTENTION_BACKENDS
from engine.execution.model_files import DEFAULT_MODEL

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. Counts are `num_*`, limits `max_*`."""

    model: str = DEFAULT_MODEL
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None  # CPU threads for torch; None leaves torch's default
    # torch.compile the target model (execution/compilation.py): faster steps, minutes of start-up
    enable_torch_compile: bool = False
    # fp32 on CPU: RMSNorm with the residual add, SiLU-and-mul, rotary, the K/V store and decode
    # attention through the fused C kernels of layers/cpu_kernels.py (built once with the
    # machine's C compiler); False: PyTorch's
    fused_cpu_kernels: bool = True
    # fp32 on CPU, eager: a pass of a few rows runs the linears padded with zero rows to the size
    # measured fastest at start-up (execution/linear_kernels.py); False: as many rows as it has
    pad_linear_passes: bool = True
    # "auto": flash-attn on CUDA in fp16/bf16 when it is installed, else torch's SDPA;
    # "torch" always SDPA; "flash" insists on flash-attn (layers/flash_attention.py)
    attention_backend: str = "auto"
    draft: str | None = None  # EAGLE-1/2 head folder; None: plain autoregressive decoding
    # The tree's defaults were chosen with benchmarks/bench_tree_sweep.py on a 2-core CPU, where
    # each head pass is dear and small, shallow trees win. GPUs want larger ones (the paper: 10, 6,
    # 60).
    draft_top_k: int = 4  # children scored per expanded node
    draft_depth: int = 2  # draft layers (head passes per step)
    draft_total_tokens: int = 4  # tree nodes verified per sequence at most, the root included
    # Whether a step drafts is chosen from measured whole steps, per batch size, and per request
    # from its own acceptance; a drafting step verifies only the nodes worth their verify cost
    # (docs/draft-controller.md). False: every step drafts and verifies whole trees.
    adaptive_draft_budget: bool = True
    # Steps of a batch size after which the controller weighs what it measured half as much:
    # shorter follows changes faster, longer loses less to exploring the worse choice.
    draft_controller_half_life: int = 128
    # fp32 on CPU: the draft head's linears and the draft lm_head keep their weights in fp16 and
    # multiply through FBGEMM's fp16 GEMM (layers/fp16_linear.py): half of drafting's weight
    # reads; drafts only, so outputs do not change. False: fp32, as the target's
    fp16_draft_weights: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size must be >= 1")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"
        )
        _require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib must be > 0")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"
        )
        _require(
            self.dtype == "auto" or self.dtype in _DTYPES,
            f"dtype must be 'auto' or one of {sorted(_DTYPES)}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {list(ATTENTION_BACKENDS)}",
        )
        _require(self.draft_top_k >= 1, "draft_top_k must be >= 1")
        _require(self.draft_depth >= 1, "draft_depth must be >= 1")
        _require(self.draft_total_tokens >= 2, "draft_total_tokens must be >= 2")
        _require(self.draft_controller_half_life >= 1, "draft_controller_half_life must be >= 1")
        max_nodes = self.draft_top_k + (self.draft_depth - 1) * self.draft_top_k**2
        _require(
            self.draft_total_tokens - 1 <= max_nodes,
            f"draft_total_tokens - 1 must not exceed the {max_nodes} nodes a tree of "
            "this top_k and depth generates",
        )
        _require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device must be 'auto', 'cpu' or 'cuda[:N]'",
        )

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """Build a config from keyword options, rejecting unknown names clearly."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise AerieError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **options)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise AerieError(f"{path}: expected a mapping of engine options")
        data.update({k: v for k, v in overrides.items() if v is not None})
        model = data.pop("model", cls.model)
        return cls.from_options(model, **data)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AerieError(message)
