"""What speculation costs under load: AR and EAGLE (adaptive budget) stepped in turns, step by step.

At high load the budget mostly decodes plainly, so the speculative engine should cost what plain
decoding does; what it spends on top (the head's catch-ups, probes, bookkeeping) is a few percent,
less than this shared machine's drift between two runs. So the two engines run the same B
requests at once (MT-bench first turns, greedy, ``--max-tokens`` new tokens, EOS banned) in one
process, taking turns one engine step at a time, and the figures are ratios of their summed step
times. Per batch size: output tokens/s of each, their ratio, mean decode-step time and its phases
(the head's propose, the target's verify), the steps that verified drafts, and the full batch's
decode steps split into drafting and plain ones (ms a step, tokens a sequence). Writes
``load_overhead.json`` and ``load_overhead.png`` to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_load_overhead.py    # ~5 minutes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.stats import StepStats

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"


class EngineRun:
    """One engine's requests of a round, stepped from outside, with each step's wall time."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.steps = llm, []  # (seconds, StepStats)
        self.stats: list[StepStats] = []
        self.token_ids: dict[str, list[int]] = {}  # request id -> its output tokens
        llm.engine.stats_listeners[:] = [self.stats.append]

    def step(self) -> None:
        started = time.perf_counter()
        deltas = self.llm.engine.step()
        self.steps.append((time.perf_counter() - started, self.stats[-1]))
        for delta in deltas:
            tokens = self.token_ids.setdefault(delta.request_id, [])
            for output in delta.outputs:  # one: n = 1
                tokens.extend(output.token_ids)

    @property
    def busy(self) -> bool:
        return self.llm.engine.has_unfinished_requests()


def run_round(llms: dict[str, LLM], prompts, params, tag: str) -> dict[str, EngineRun]:
    runs = {name: EngineRun(llm) for name, llm in llms.items()}
    for llm in llms.values():
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"{tag}-{i}", prompt, params)
    while any(run.busy for run in runs.values()):
        for run in runs.values():
            if run.busy:
                run.step()
    return runs


def summarize(runs: list[EngineRun], batch: int) -> dict:
    """An engine's rounds at one batch size: tokens/s over all steps, decode-step means, and
    the decode steps with all `batch` requests running split by kind."""
    steps = [s for run in runs for s in run.steps]
    decode = [(seconds, stats) for seconds, stats in steps if stats.num_prompt_tokens == 0]
    seconds = sum(s for s, _ in steps)
    tokens = sum(stats.num_generation_tokens for _, stats in steps)
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "decode_steps": len(decode),
        "decode_step_ms": 1000 * sum(s for s, _ in decode) / len(decode),
        "propose_ms": 1000 * sum(st.propose_time_s for _, st in decode) / len(decode),
        "verify_ms": 1000 * sum(st.verify_time_s for _, st in decode) / len(decode),
        "steps_verifying_drafts": sum(1 for _, st in decode if st.num_drafts),
        "full_batch_steps": step_kinds(decode, batch),
    }


def step_kinds(decode: list[tuple[float, StepStats]], batch: int) -> dict:
    """Decode steps of all `batch` requests that verified drafts and those that did not: their
    count, ms a step and tokens a sequence (what the realized rates compare)."""
    kinds = {}
    for kind, drafted in (("drafting", True), ("plain", False)):
        steps = [
            (seconds, stats)
            for seconds, stats in decode
            if stats.num_running == batch and bool(stats.num_drafts) == drafted
        ]
        if steps:
            tokens = sum(stats.num_generation_tokens for _, stats in steps)
            kinds[kind] = {
                "steps": len(steps),
                "step_ms": 1000 * sum(seconds for seconds, _ in steps) / len(steps),
                "tokens_per_sequence": tokens / (batch * len(steps)),
            }
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8,16,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per batch size")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    options = dict(max_num_seqs=max(64, *batches), kv_cache_memory_gib=1.0)
    llms = {"ar": LLM(MODEL, draft=None, **options), "eagle": LLM(MODEL, draft="auto", **options)}
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [
        llms["ar"].apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions[: max(batches)]
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    warm_up = SamplingParams(temperature=0, max_tokens=8)
    for llm in llms.values():
        llm.generate(prompts[:2], warm_up, use_tqdm=False)
    results = []
    for batch in tqdm(batches, desc="batch sizes"):
        rounds = [
            run_round(llms, prompts[:batch], params, f"{batch}-{r}") for r in range(args.rounds)
        ]
        row = {"batch": batch}
        row.update({name: summarize([r[name] for r in rounds], batch) for name in llms})
        row["eagle_over_ar"] = row["eagle"]["tok_s"] / row["ar"]["tok_s"]
        results.append(row)
        print(
            f"batch {batch}: AR {row['ar']['tok_s']:.1f} tok/s, EAGLE {row['eagle']['tok_s']:.1f}"
            f" tok/s, {row['eagle_over_ar']:.3f}x; decode step {row['ar']['decode_step_ms']:.1f}"
            f" vs {row['eagle']['decode_step_ms']:.1f} ms (propose"
            f" {row['eagle']['propose_ms']:.1f}), steps verifying drafts"
            f" {row['eagle']['steps_verifying_drafts']}"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"model": MODEL, "max_tokens": args.max_tokens, "rounds": args.rounds, **options}
    out = args.out_dir / "load_overhead.json"
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, args.out_dir / "load_overhead.png")
    print(f"wrote {out}")


def plot(results: list[dict], path: Path) -> None:
    with png_figure(path) as axes:
        batches = [r["batch"] for r in results]
        axes.plot(batches, [r["eagle_over_ar"] for r in results], "o-", label="EAGLE / AR tokens/s")
        axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("requests decoding at once")
        axes.set_ylabel("EAGLE (adaptive budget) / AR")
        axes.set_title("Speculation under load, engines in turns (SmolLM2-135M, fp32, CPU)")
        axes.grid(alpha=0.3)
        axes.legend()


if __name__ == "__main__":
    main()
