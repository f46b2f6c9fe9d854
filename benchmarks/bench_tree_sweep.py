"""Which draft tree suits this machine: acceptance length and tokens/s per (top_k, depth, total).

For each tree shape, Aerie with the given EAGLE head decodes the first turns of MT-bench questions
(chat template, greedy, ``--max-tokens`` new tokens, batch 1); plain AR decoding runs on the same
prompts in the same loop, interleaved, so each shape's speedup is a ratio measured side by side.
The shape is the largest tree; the adaptive draft budget (the engine's default) verifies the part
of it worth verifying, unless ``--fixed-trees``.
Writes ``tree_sweep[_TAG].json`` and ``.png`` to ``--out-dir``. Run from the repository root:

    .venv/bin/python benchmarks/bench_tree_sweep.py --draft drafting/heads/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL
from engine.spec.draft_method import resolve_draft

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="auto", help="EAGLE head folder ('auto': shipped)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-k", default="1,2,4", help="comma-separated values to sweep")
    parser.add_argument("--depth", default="3,5")
    parser.add_argument("--total-tokens", default="4,6,10,16")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    parser.add_argument(
        "--fixed-trees",
        action="store_true",
        help="verify every tree whole (no adaptive draft budget): the shape's own acceptance",
    )
    return parser.parse_args()


def shapes(args) -> list[tuple[int, int, int]]:
    """Every combination whose tree can hold `total - 1` nodes."""
    grid = itertools.product(
        *(map(int, v.split(",")) for v in (args.top_k, args.depth, args.total_tokens))
    )
    return [(k, d, t) for k, d, t in grid if t - 1 <= k + (d - 1) * k * k and t - 1 >= d - 1]


def prompts_of(llm: LLM, count: int) -> list[list[int]]:
    lines = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return [
        llm.apply_chat_template([{"role": "user", "content": q["turns"][0]}]) for q in lines[:count]
    ]


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    """(seconds, acceptance length, tokens) of one greedy request."""
    start = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = len(output.outputs[0].token_ids)
    passes = max(1, output.metrics.num_decode_steps)
    return seconds, (tokens - 1) / passes, tokens


def main() -> None:
    args = parse_args()
    draft = resolve_draft(DEFAULT_MODEL, args.draft)
    if not draft:
        raise SystemExit("no draft head: pass --draft HEAD_FOLDER")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    plain = LLM(DEFAULT_MODEL, draft=None)
    prompts = prompts_of(plain, args.num_prompts)
    results = []
    for top_k, depth, total in tqdm(shapes(args), desc="tree shapes"):
        spec = LLM(
            DEFAULT_MODEL,
            draft=draft,
            draft_top_k=top_k,
            draft_depth=depth,
            draft_total_tokens=total,
            adaptive_draft_budget=not args.fixed_trees,
        )
        timed(spec, prompts[0], params)  # warm-up
        ar_s = spec_s = tokens = 0.0
        lengths = []
        for prompt in prompts:
            seconds, _, n = timed(plain, prompt, params)
            ar_s += seconds
            seconds, length, n = timed(spec, prompt, params)
            spec_s, tokens = spec_s + seconds, tokens + n
            lengths.append(length)
        results.append(
            {
                "top_k": top_k,
                "depth": depth,
                "total_tokens": total,
                "acceptance_length": sum(lengths) / len(lengths),
                "spec_tok_s": tokens / spec_s,
                "ar_tok_s": tokens / ar_s,
                "speedup": ar_s / spec_s,
            }
        )
        del spec
    results.sort(key=lambda r: -r["speedup"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": DEFAULT_MODEL,
        "draft": draft,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "greedy": True,
        "batch": 1,
        "adaptive_draft_budget": not args.fixed_trees,
    }
    stem = f"tree_sweep_{args.tag}" if args.tag else "tree_sweep"
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps({"settings": settings, "results": results}, indent=2) + "\n"
    )
    plot(results, args.out_dir / f"{stem}.png")
    for r in results:
        print(
            f"top_k {r['top_k']} depth {r['depth']} total {r['total_tokens']:>2}: acceptance "
            f"{r['acceptance_length']:.2f}, {r['spec_tok_s']:.1f} tok/s, "
            f"{r['speedup']:.2f}x AR"
        )


def plot(results: list[dict], path: Path) -> None:
    with png_figure(path, ncols=2, figsize=(11, 4.5)) as (left, right):
        for top_k, depth in sorted({(r["top_k"], r["depth"]) for r in results}):
            rows = sorted(
                (r for r in results if (r["top_k"], r["depth"]) == (top_k, depth)),
                key=lambda r: r["total_tokens"],
            )
            label = f"top_k {top_k}, depth {depth}"
            totals = [r["total_tokens"] for r in rows]
            left.plot(totals, [r["acceptance_length"] for r in rows], marker="o", label=label)
            right.plot(totals, [r["speedup"] for r in rows], marker="o", label=label)
        left.set(xlabel="total_tokens (tree nodes verified)", ylabel="mean acceptance length")
        right.set(xlabel="total_tokens (tree nodes verified)", ylabel="speedup over AR (batch 1)")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.legend(fontsize=7, ncol=2)
        left.figure.suptitle(
            f"{DEFAULT_MODEL}: EAGLE-2 tree shapes, greedy MT-bench first turns, batch 1"
        )


if __name__ == "__main__":
    main()
