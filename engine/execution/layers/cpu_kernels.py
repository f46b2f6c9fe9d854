"""Fused float32 CPU kernels: RMSNorm (alone and after the residual add), SiLU-and-mul, rotary,
the K/V store and decode attention over the paged cache.

At the few rows of a decode step each of these is a chain of small PyTorch kernels whose dispatch,
allocation and thread wake-ups cost more than their arithmetic (benchmarks/bench_pass_breakdown.py).
`cpu_kernels.c` does each in one call, as vLLM's CPU backend and llama.cpp do; attention reads K/V
through the block tables in place, with flash attention's online softmax. It is compiled once per
machine with the machine's C compiler (`$CC`, default `cc`; `-O3 -march=native`, OpenMP on PyTorch's
own runtime) into `$AERIE_CACHE/kernels/` and loaded through ctypes. Two failures are told apart: no
compiler on the machine (NoCompilerError) and a compiler that does not build or load the source
(KernelBuildError, with its message). The engine logs either and runs PyTorch's kernels
(load_cpu_kernels); tests skip only the first.

The kernels compute each row alone, in an order that does not depend on the batch, and agree with
PyTorch's to float rounding (sums run in another order). Inference only: no gradient flows through
them, so only the engine attaches them (`use_cpu_kernels`), never training.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from engine.execution.layers.paged_attention import AttentionMetadata, group_attention
from engine.execution.model_files import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
# Attention groups whose sequences bring at most this many queries run the fused kernel: decodes
# and draft trees. Groups of more (prefill chunks) run SDPA, whose matmuls win from about 8 queries
# on (benchmarks/bench_decode_attention.py).
FUSED_MAX_QUERIES = 8
MAX_ROWS = 1024  # a fused task's query rows at most (cpu_kernels.c)
MAX_HEAD_DIM = 256  # a fused task's head size at most (cpu_kernels.c)
TILE = 64  # attention's entries per softmax rescale (cpu_kernels.c)
_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": (_POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _FLOAT),
    "add_rms_norm": (_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _FLOAT),
    "silu_and_mul": (_POINTER, _POINTER, _INT, _INT),
    "rotary": (_POINTER, _INT, _INT, _INT, _INT, _POINTER, _POINTER),
    "store_kv": (_POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT, _POINTER, _POINTER),
    "paged_attention": (
        *(_POINTER, _INT, _POINTER, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _POINTER),
        *(_INT, _INT, _INT, _INT, _INT, _INT, _FLOAT, _POINTER, _POINTER, ctypes.c_int),
    ),
}


class CpuKernels:
    """The compiled kernels, called on contiguous float32 CPU tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight over the last dim; x [..., n] with its rows evenly strided."""
        n = x.shape[-1]
        rows = x.reshape(-1, n)  # [R, n], a view where x's strides allow
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)  # [R, n]
        self.library.rms_norm(
            rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), len(rows), n, eps
        )
        return out.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x in place, and rms_norm(residual) * weight; both contiguous [R, n]."""
        x = x.contiguous()
        out = torch.empty_like(residual)  # [R, n]
        rows, n = residual.shape
        self.library.add_rms_norm(
            residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n, eps
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of contiguous gate_up [R, 2 * n] = [gate, up] -> [R, n]."""
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype)
        self.library.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, n)
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate x [T, heads, head_dim] in place (each token's heads contiguous) by cos and
        signed_sin [T, 1, head_dim] (engine/execution/layers/rotary.py)."""
        tokens, heads, head_dim = x.shape
        self.library.rotary(
            x.data_ptr(),
            x.stride(0),
            tokens,
            heads,
            head_dim,
            cos.contiguous().data_ptr(),
            signed_sin.contiguous().data_ptr(),
        )

    def store_kv(
        self,
        k: torch.Tensor,  # [T, KV, D], heads contiguous within a token
        v: torch.Tensor,  # [T, KV, D], likewise
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] contiguous
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Write the tokens' K/V to their flat cache slots."""
        num_tokens, num_kv_heads, head_dim = k.shape
        self.library.store_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slot_mapping.data_ptr(),
            num_tokens,
            num_kv_heads * head_dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, H, D], heads contiguous within a token
        k: torch.Tensor,  # [T, KV, D], likewise
        v: torch.Tensor,  # [T, KV, D], likewise, tokens as far apart as k's
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] contiguous
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        fused_max_queries: int = FUSED_MAX_QUERIES,
    ) -> torch.Tensor:  # [T, H * D]
        """Store the new tokens' K/V, then each query's attention over its sequence's entries
        (layers/paged_attention.py's semantics, masks included): in the fused kernel for
        groups of at most `fused_max_queries` queries per sequence, in SDPA for the others."""
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        library = self.library
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)  # [T, H * D]
        for group in meta.groups:
            batch, max_blocks = group.block_tables.shape
            num_queries = group.mask.shape[2]
            too_big = num_queries * num_heads > MAX_ROWS * num_kv_heads or head_dim > MAX_HEAD_DIM
            if num_queries > fused_max_queries or too_big:
                out[group.tokens] = group_attention(q, k, k_cache, v_cache, group, scale)
                continue
            scratch = torch.empty(batch * num_heads * num_queries, TILE + 2, dtype=torch.float32)
            library.paged_attention(
                q.data_ptr(),
                q.stride(0),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                group.block_tables.data_ptr(),
                max_blocks,
                group.mask.data_ptr(),
                group.first_token.data_ptr(),
                group.num_new.data_ptr(),
                batch,
                num_queries,
                block_size,
                num_heads,
                num_kv_heads,
                head_dim,
                scale,
                out.data_ptr(),
                scratch.data_ptr(),
                torch.get_num_threads(),
            )
        return out


class NoCompilerError(FileNotFoundError):
    """This machine has no C compiler: the kernels cannot be built here."""


class KernelBuildError(RuntimeError):
    """A C compiler is present, but the kernels did not build or load: a defect to fix, not a
    machine without the means."""


def build_cpu_kernels() -> CpuKernels:
    """The kernels built for this machine (compiled on first use); raises NoCompilerError or
    KernelBuildError (with the compiler's or the loader's message)."""
    library = _built_library()
    try:
        return CpuKernels(ctypes.CDLL(str(library)))
    except (OSError, AttributeError) as exc:  # not a shared library, or a function missing
        raise KernelBuildError(f"{library} does not load: {exc}") from exc


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels built for this machine, or None, logged, where they cannot be built or
    loaded: the engine then runs PyTorch's kernels."""
    try:
        return build_cpu_kernels()
    except (NoCompilerError, KernelBuildError) as exc:
        logger.warning("fused CPU kernels unavailable, using PyTorch's: %s", exc)
        return None


def _built_library() -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NoCompilerError(f"no C compiler '{compiler}' (set $CC)")
    try:
        return _compiled(compiler)
    except (OSError, subprocess.SubprocessError) as exc:  # it would not run, or timed out
        raise KernelBuildError(f"{compiler} could not build {SOURCE.name}: {exc}") from exc


def _compiled(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    key = "\n".join([SOURCE.read_text(), compiler, version, *FLAGS, _cpu_description()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise KernelBuildError(
                f"{compiler} failed on {SOURCE.name}: {result.stderr.strip()[-2000:]}"
            )
        os.replace(built, target)  # atomic: a concurrent build or reader sees a whole file
    logger.info("built fused CPU kernels: %s", target)
    return target


def _cpu_description() -> str:
    """What -march=native compiles for: the CPU's model and flags, where Linux says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in info.splitlines() if line.startswith(wanted)}))


def can_use_cpu_kernels(model: nn.Module) -> bool:
    """Whether the kernels can run this model: float32 weights on the CPU."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32


def use_cpu_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Let every layer of `model` that has a fused form use `kernels` (None: PyTorch's)."""
    for module in model.modules():
        if hasattr(module, "cpu_kernels"):
            module.cpu_kernels = kernels
