"""Draft weights in fp16 or fp32: what FBGEMM's fp16 GEMM for the head and the draft lm_head buys.

AR, EAGLE with fp16 draft weights (`fp16_draft_weights`, the default on CPU) and EAGLE with fp32
ones, in one process, stepped in turns one engine step at a time (as bench_load_overhead.py does),
on the same requests: MT-bench first turns, greedy, ``--max-tokens`` new tokens, EOS banned. At
each batch size B, ``--rounds`` rounds of B requests started together, each round on the next B
questions. Per batch size and engine: output tokens/s, its ratio to AR's, the mean decode step and
its propose (drafting) phase, the steps that verified drafts, the mean acceptance length of those,
and whether the outputs equal AR's. Writes ``draft_weights.json`` and ``draft_weights.png`` to
``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_draft_weights.py    # ~4 minutes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from engine import LLM, SamplingParams

from bench_load_overhead import run_round, summarize
from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
ENGINES = {  # name -> options beside the model's
    "ar": dict(draft=None),
    "fp16 drafts": dict(draft="auto", fp16_draft_weights=True),
    "fp32 drafts": dict(draft="auto", fp16_draft_weights=False),
}


def acceptance_length(runs) -> float | None:
    """Tokens per target pass of the sequences that verified drafts (the bonus included)."""
    stats = [stats for run in runs for _, stats in run.steps]
    drafts = sum(s.num_drafts for s in stats)
    return sum(sum(s.tokens_per_pass) for s in stats) / drafts if drafts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--rounds", default="10,3,1", help="rounds per batch size")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rounds = [int(r) for r in args.rounds.split(",")]
    options = dict(max_num_seqs=max(64, *batches), kv_cache_memory_gib=1.0)
    llms = {name: LLM(MODEL, **engine, **options) for name, engine in ENGINES.items()}
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [
        llms["ar"].apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    warm_up = SamplingParams(temperature=0, max_tokens=8)
    for llm in llms.values():
        llm.generate(prompts[:2], warm_up, use_tqdm=False)
    results = []
    for batch, num_rounds in tqdm(list(zip(batches, rounds)), desc="batch sizes"):
        runs = [
            run_round(llms, prompts[r * batch : (r + 1) * batch], params, f"{batch}-{r}")
            for r in range(num_rounds)
        ]
        row = {"batch": batch, "rounds": num_rounds}
        for name in llms:
            engine_runs = [r[name] for r in runs]
            row[name] = summarize(engine_runs)
            row[name]["acceptance_length"] = acceptance_length(engine_runs)
            row[name]["vs_ar"] = row[name]["tok_s"] / row["ar"]["tok_s"]
            row[name]["same_as_ar"] = all(r[name].token_ids == r["ar"].token_ids for r in runs)
        results.append(row)
        print(f"batch {batch}: " + "; ".join(_line(name, row[name]) for name in llms))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"model": MODEL, "max_tokens": args.max_tokens, **options}
    out = args.out_dir / "draft_weights.json"
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, args.out_dir / "draft_weights.png")
    print(f"wrote {out}")


def _line(name: str, result: dict) -> str:
    acceptance = result["acceptance_length"]
    return (
        f"{name} {result['tok_s']:.1f} tok/s ({result['vs_ar']:.3f}x AR), propose"
        f" {result['propose_ms']:.2f} ms/step, acceptance"
        f" {'-' if acceptance is None else f'{acceptance:.2f}'}"
        f"{'' if result['same_as_ar'] else ', OUTPUTS DIFFER'}"
    )


def plot(results: list[dict], path: Path) -> None:
    with png_figure(path) as axes:
        batches = [r["batch"] for r in results]
        for name in ENGINES:
            if name != "ar":
                axes.plot(batches, [r[name]["vs_ar"] for r in results], "o-", label=name)
        axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("requests decoding at once")
        axes.set_ylabel("tokens/s over AR's")
        axes.set_title("Draft weights in fp16 (FBGEMM) or fp32 (SmolLM2-135M, CPU)")
        axes.grid(alpha=0.3)
        axes.legend()


if __name__ == "__main__":
    main()
