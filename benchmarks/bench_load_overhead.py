"""What speculation costs under load: AR and EAGLE (draft controller) stepped in turns, by step.

At high load the draft controller mostly decodes plainly, so the speculative engine should cost what
plain decoding does; what it spends on top (exploring, the head's catch-ups, bookkeeping) is a few
percent, less than this shared machine's drift between two runs. So the two engines serve the same
requests in one process, taking turns one engine step at a time, and the figures are ratios of their
summed step times. Each engine keeps B requests running, as a server does under B clients: when one
finishes, the next is admitted (MT-bench first turns, or ``--prompts FILE [--category C]``, in
order, cycled; greedy, EOS banned, lengths spread evenly from half to one and a half times
``--max-tokens``, the same for both), until ``(rounds + 1) * B`` requests have been admitted. The
figures are over the steady state: from the step at which its first B requests have all finished
(the start-up, when they were prefilled together and the draft controller first learned this batch
size, is over: a server pays it once) until the last request is admitted (the last B then drain).
The ratio over every step, start-up and drain included, is reported beside.

Two things about the requests matter to the ratio. Requests of one length started together
finish together under AR, and the next ones are then prefilled in one large pass, while
speculation's finish apart and are prefilled a few at a time beside the decodes, which costs more
per prompt token: a lockstep that real traffic, of varied lengths and arrivals, does not have.
And a fixed set of requests started together drains unevenly under speculation at the end, a tail
a steady stream of requests does not have.

Per batch size: output tokens/s of each, their ratio, mean decode-step time and its phases (the
head's propose, the target's verify), the steps that verified drafts, and the decode steps of all
B requests split into drafting and plain ones (ms a step, tokens a sequence). Writes
``load_overhead.json`` and ``load_overhead.png`` to ``--out-dir`` (``load_overhead_<variant>``
with ``--useless-head``, a head of random weights, or ``--never-draft``, the controller fixed to
plain steps: what a plain step costs beside ``--draft none``; ``_<category>`` appended with
``--category``). From the repository root:

    .venv/bin/python benchmarks/bench_load_overhead.py    # ~12 minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from collections import deque
from pathlib import Path

from random_head import useless_head
from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL
from engine.stats import StepStats
from server.serving_benchmark import load_prompts

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"


class EngineRun:
    """One engine's requests of a round, stepped from outside, with each step's wall time."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.steps = llm, []  # (seconds, StepStats)
        self.stats: list[StepStats] = []
        self.token_ids: dict[str, list[int]] = {}  # request id -> its output tokens
        self.steady = slice(0, 0)  # its steps in the steady state (see `run_refilled`)
        self.num_finished = 0  # requests
        llm.engine.stats_listeners[:] = [self.stats.append]

    def step(self) -> None:
        started = time.perf_counter()
        deltas = self.llm.engine.step()
        self.steps.append((time.perf_counter() - started, self.stats[-1]))
        self.num_finished += len(self.stats[-1].finished)
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


def run_refilled(
    llms: dict[str, LLM], requests: list[tuple[str, SamplingParams]], in_flight: int, tag: str
) -> dict[str, EngineRun]:
    """Each engine keeps `in_flight` of `requests` (prompt, params) running, admitting the next
    as one finishes, until all have run; the engines take turns a step at a time. Each run's
    `steady` steps come after its first `in_flight` requests have finished (the start-up, when
    they were prefilled together and the draft controller first learned this batch size, is over)
    and while requests still waited to be admitted (the drain is not begun)."""
    runs = {name: EngineRun(llm) for name, llm in llms.items()}
    waiting = {name: deque(enumerate(requests)) for name in llms}
    while any(run.busy or waiting[name] for name, run in runs.items()):
        for name, run in runs.items():
            queue, engine = waiting[name], run.llm.engine
            while queue and len(engine.requests) < in_flight:
                index, (prompt, params) = queue.popleft()
                engine.add_request(f"{tag}-{index}", prompt, params)
            if run.busy:
                run.step()
                if run.num_finished < in_flight:
                    run.steady = slice(len(run.steps), len(run.steps))
                elif queue:
                    run.steady = slice(run.steady.start, len(run.steps))
    return runs


def request_params(count: int, mean: int, spread: bool = True) -> list[SamplingParams]:
    """Greedy, EOS banned, `count` requests of `mean / 2` to `3 * mean / 2` new tokens, spread
    evenly, in a fixed shuffled order (see the module's docstring for why not all `mean`); all
    of `mean` without `spread`."""
    if not spread:
        return [SamplingParams(temperature=0, max_tokens=mean, min_tokens=mean)] * count
    low = mean // 2
    spread = [low + (i * mean) // max(count - 1, 1) for i in range(count)]  # low .. low + mean
    random.Random(0).shuffle(spread)
    return [SamplingParams(temperature=0, max_tokens=n, min_tokens=n) for n in spread]


def summarize(runs: list[EngineRun], batch: int, steady_only: bool = False) -> dict:
    """An engine's rounds at one batch size: tokens/s over all steps (the steady ones only,
    with `steady_only`), decode-step means, and the decode steps with all `batch` requests
    running split by kind, and the steps that computed prompt tokens (beside any decodes):
    their count and ms a prompt token."""
    steps = [s for run in runs for s in (run.steps[run.steady] if steady_only else run.steps)]
    decode = [(seconds, stats) for seconds, stats in steps if stats.num_prompt_tokens == 0]
    prefill = [(seconds, stats) for seconds, stats in steps if stats.num_prompt_tokens]
    prompt_tokens = sum(stats.num_prompt_tokens for _, stats in prefill)
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
        "prompt_steps": len(prefill),
        "ms_per_prompt_token": 1000 * sum(s for s, _ in prefill) / max(prompt_tokens, 1),
    }


def step_kinds(decode: list[tuple[float, StepStats]], batch: int) -> dict:
    """Decode steps of all `batch` requests that verified drafts and those that did not: their
    count, ms a step and tokens a sequence (what the draft controller compares)."""
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
    parser.add_argument(
        "--rounds", type=int, default=3, help="requests per batch size B: (rounds + 1) x B"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--one-length", action="store_true", help="every request --max-tokens long (lockstep)"
    )
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--prompts", type=Path, default=QUESTIONS, help="JSONL (MT-bench's)")
    parser.add_argument("--category", default=None, help="only the prompts of this category")
    parser.add_argument("--useless-head", action="store_true", help="random head weights")
    parser.add_argument("--never-draft", action="store_true", help="the controller: plain only")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    options = dict(max_num_seqs=max(64, *batches), kv_cache_memory_gib=1.0)
    scratch = tempfile.TemporaryDirectory()
    head = useless_head(DEFAULT_MODEL, Path(scratch.name)) if args.useless_head else "auto"
    llms = {
        "ar": LLM(DEFAULT_MODEL, draft=None, **options),
        "eagle": LLM(DEFAULT_MODEL, draft=str(head), **options),
    }
    if args.never_draft:
        llms["eagle"].engine.policy.controller.choose = lambda num_decoding: False
    variant = "_useless-head" if args.useless_head else "_never-draft" if args.never_draft else ""
    variant += f"_{args.category}" if args.category else ""
    prompts = [llms["ar"].apply_chat_template(m) for m in load_prompts(args.prompts, args.category)]
    warm_up = SamplingParams(temperature=0, max_tokens=8)
    for llm in llms.values():
        llm.generate(prompts[:2], warm_up, use_tqdm=False)
    results = []
    for batch in tqdm(batches, desc="batch sizes"):
        count = (args.rounds + 1) * batch
        requests = list(
            zip(
                itertools.islice(itertools.cycle(prompts), count),
                request_params(count, args.max_tokens, spread=not args.one_length),
            )
        )
        runs = run_refilled(llms, requests, batch, f"{batch}")
        row = {"batch": batch}
        row.update({name: summarize([runs[name]], batch, steady_only=True) for name in llms})
        row["eagle_over_ar"] = row["eagle"]["tok_s"] / row["ar"]["tok_s"]
        whole = {name: summarize([runs[name]], batch)["tok_s"] for name in llms}
        row["eagle_over_ar_every_step"] = whole["eagle"] / whole["ar"]
        results.append(row)
        print(
            f"batch {batch}: AR {row['ar']['tok_s']:.1f} tok/s, EAGLE {row['eagle']['tok_s']:.1f}"
            f" tok/s, {row['eagle_over_ar']:.3f}x ({row['eagle_over_ar_every_step']:.3f}x over"
            f" every step); decode step {row['ar']['decode_step_ms']:.1f}"
            f" vs {row['eagle']['decode_step_ms']:.1f} ms (propose"
            f" {row['eagle']['propose_ms']:.1f}), steps verifying drafts"
            f" {row['eagle']['steps_verifying_drafts']}; prompt steps"
            f" {row['ar']['prompt_steps']} vs {row['eagle']['prompt_steps']}"
            f" ({row['ar']['ms_per_prompt_token']:.2f} vs"
            f" {row['eagle']['ms_per_prompt_token']:.2f} ms a prompt token)"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": DEFAULT_MODEL,
        "prompts": args.prompts.name,
        "category": args.category,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        **options,
    }
    settings["head"] = "useless (random weights)" if args.useless_head else "shipped"
    settings["controller"] = "fixed to plain steps" if args.never_draft else "default"
    settings["arrivals"] = (
        "B requests kept running, refilled as they finish; lengths "
        + ("all max_tokens" if args.one_length else "spread evenly over 0.5-1.5x max_tokens")
        + "; steady state: from the first B finished to the last admitted"
    )
    out = args.out_dir / f"load_overhead{variant}.json"
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, args.out_dir / f"load_overhead{variant}.png")
    print(f"wrote {out}")


def plot(results: list[dict], path: Path) -> None:
    with png_figure(path) as axes:
        batches = [r["batch"] for r in results]
        axes.plot(batches, [r["eagle_over_ar"] for r in results], "o-", label="steady state")
        every_step = [r["eagle_over_ar_every_step"] for r in results]
        axes.plot(batches, every_step, "s--", label="every step (start-up and drain too)")
        axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("requests decoding at once")
        axes.set_ylabel("EAGLE (draft controller) / AR tokens/s")
        axes.set_title("Speculation under load, engines in turns (SmolLM2-135M, fp32, CPU)")
        axes.grid(alpha=0.3)
        axes.legend()


if __name__ == "__main__":
    main()
