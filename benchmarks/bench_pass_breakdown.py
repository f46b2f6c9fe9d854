"""Where a one-token pass of the default model spends its time outside the matmuls, on CPU.

Every round times, in turn, the engine's one-token pass (fp32, a 64-entry context, as the draft
budget's start-up measurement runs it) under each variant below, and the model's linears alone
(the same calls at one row, nothing between them), so that the machine's drift hits all alike.
Reports the median and the fastest of `--rounds` per variant:

* the pass with the engine's fused CPU kernels (RMSNorm with the residual add, SiLU-and-mul,
  rotary, K/V store and decode attention in C: engine/execution/layers/cpu_kernels.py), and without
  them: PyTorch's kernels, as every variant below runs;
* ablations, each leaving a piece out (the pass's output is then wrong; only its time counts):
  without the RMSNorms, without rotary, without attention (no K/V stored or read);
* the formulations the engine used before, each alone and both together: rotate-half by slicing,
  negating and concatenating (the engine now folds the sign into its sin table and swaps the
  halves with one flip), and every layer called through `nn.Module.__call__` (the engine's layers
  now call their forward directly).

Writes ``pass_breakdown.json`` and ``.png`` to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_pass_breakdown.py    # ~2 minutes (200 rounds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from engine.execution.layers import attention, norm
from engine.execution.layers.cpu_kernels import use_cpu_kernels
from engine.execution.layers.cpu_linear import cpu_linears
from engine.execution.layers.direct_call import DirectCallModule
from engine.execution.layers.rotary import RotaryEmbedding
from engine.execution.model_files import DEFAULT_MODEL
from engine.llm import LLM

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def patched(owner, name: str, value) -> Iterator[None]:
    """`owner.name` set to `value` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _unsigned_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
    """The plain sin table back from the signed one (its second half is sin)."""
    half = self.signed_sin.shape[-1] // 2
    sin = self.signed_sin[positions, half:]  # [T, head_dim // 2]
    return self.cos[positions].unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)


def _rotate_half_by_cat(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _no_attention(q, k, v, k_cache, v_cache, meta, scale) -> torch.Tensor:  # [T, H * D]
    return q.reshape(q.shape[0], -1)


PREVIOUS = {  # what each of the engine's earlier formulations patches back
    "rotate-half by cat": [
        (RotaryEmbedding, "cos_sin", _unsigned_cos_sin),
        (attention, "apply_rotary", _rotate_half_by_cat),
    ],
    "nn.Module call path": [(DirectCallModule, "__call__", nn.Module.__call__)],
}
FUSED = "pass, fused CPU kernels"  # the only variant with layers/cpu_kernels.c attached
VARIANTS = {
    FUSED: [],
    "pass": [],
    "without norms": [(norm.RMSNorm, "forward", lambda self, x: x)],
    "without rotary": [(attention, "apply_rotary", lambda x, cos, sin: x)],
    "without attention": [(attention, "paged_attention", _no_attention)],
    **{f"previous {name}": patches for name, patches in PREVIOUS.items()},
    "previous, both": [p for patches in PREVIOUS.values() for p in patches],
}


def timed_pass(runner, variant: str, patches: list) -> float:
    use_cpu_kernels(runner.model, runner.cpu_kernels if variant == FUSED else None)
    with ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(patched(owner, name, value))
        started = time.perf_counter()
        runner.synthetic_pass(1, 1)
        return time.perf_counter() - started


def linear_chain(model: nn.Module) -> Callable[[], float]:
    """Seconds of the model's linears alone, each on one row, in pass order."""
    linears = cpu_linears(model)
    rows = {layer.in_features: torch.randn(1, layer.in_features) for layer in linears}

    @torch.inference_mode()
    def run() -> float:
        started = time.perf_counter()
        for layer in linears:
            layer(rows[layer.in_features])
        return time.perf_counter() - started

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    llm = LLM(args.model, draft=None)
    runner = llm.engine.runner
    linears = linear_chain(runner.model)
    seconds: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "linears alone"]}
    for round_ in tqdm(range(args.rounds + 1), desc="rounds"):  # the first only warms up
        for name, patches in VARIANTS.items():
            elapsed = timed_pass(runner, name, patches)
            if round_:
                seconds[name].append(elapsed)
        elapsed = linears()
        if round_:
            seconds["linears alone"].append(elapsed)
    results = {
        name: {
            "median_ms": round(1000 * statistics.median(times), 2),
            "min_ms": round(1000 * min(times), 2),
        }
        for name, times in seconds.items()
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "blas_max_rows": runner.linear_kernels.blas_max_rows,
        "packed_format": runner.linear_kernels.packed_format,
    }
    path = args.out_dir / "pass_breakdown.json"
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, args.out_dir / "pass_breakdown.png")
    for name, figures in results.items():
        median, fastest = figures["median_ms"], figures["min_ms"]
        print(f"{name:>36}: median {median:6.2f} ms, fastest {fastest:6.2f} ms")


def plot(results: dict, path: Path) -> None:
    with png_figure(path, figsize=(9, 4.5)) as axes:
        names = list(results)
        axes.barh(names, [results[n]["median_ms"] for n in names], color="tab:blue")
        axes.invert_yaxis()
        axes.set(xlabel="median ms", title="default model, fp32 CPU: one-token pass by variant")


if __name__ == "__main__":
    main()
