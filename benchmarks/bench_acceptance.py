"""A head's own acceptance length on MT-bench: whole trees, no draft budget, greedy.

For each head and tree shape (top_k, depth, total_tokens), the first turns of the first
``--num-prompts`` MT-bench questions decode ``--max-tokens`` tokens in one batch, and the mean
acceptance length (tokens per target pass, bonus included) is recorded. Speed is not measured.
Writes ``acceptance.json`` (``acceptance_TAG.json`` with ``--tag``) to ``--out-dir``. From the
repository root:

    .venv/bin/python benchmarks/bench_acceptance.py auto runs/smollm2-head-d2t
    .venv/bin/python benchmarks/bench_acceptance.py auto --shapes 4,2,4 --tag default-tree
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL
from engine.spec.draft_method import resolve_draft

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
SHAPES = "2,3,4;4,5,16;8,6,32"  # top_k,depth,total_tokens per shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", help="head folders ('auto': the shipped head)")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shapes", default=SHAPES, help="top_k,depth,total_tokens;... to measure")
    parser.add_argument("--tag", default="", help="write acceptance_TAG.json")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    shapes = [tuple(int(v) for v in shape.split(",")) for shape in args.shapes.split(";")]
    results = []
    for head in args.heads:
        for top_k, depth, total in shapes:
            llm = LLM(
                DEFAULT_MODEL,
                draft=resolve_draft(DEFAULT_MODEL, head),
                adaptive_draft_budget=False,
                draft_top_k=top_k,
                draft_depth=depth,
                draft_total_tokens=total,
            )
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
                for q in questions[: args.num_prompts]
            ]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
            passes = sum(o.metrics.num_decode_steps for o in outputs)
            row = {"head": head, "top_k": top_k, "depth": depth, "total_tokens": total}
            results.append({**row, "acceptance_length": tokens / passes})
            print(results[-1], flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": DEFAULT_MODEL,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
    }
    name = f"acceptance_{args.tag}.json" if args.tag else "acceptance.json"
    (args.out_dir / name).write_text(
        json.dumps({"settings": settings, "results": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
