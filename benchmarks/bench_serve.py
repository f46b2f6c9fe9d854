"""Serving throughput and latency under load: Aerie with speculation, without, and transformers.

One run, side by side, on the default model (smollm2-135m-instruct, fp32), MT-bench first turns
(or `--prompts FILE [--category C]`, e.g. the dev set's code prompts), greedy, `--max-tokens` new
tokens per request (EOS ignored, so every configuration emits the same number of tokens; with
`--range-ratio r` request i asks for max_tokens x (1 +- r), the same for each server), over a
concurrency sweep with `aerie bench serve` (server/serving_benchmark.py):

* `aerie-spec`: `aerie serve` with the shipped EAGLE head and the draft controller (default);
* `aerie-spec-useless`: the same with a useless head (the shipped head's shape, random weights,
  benchmarks/random_head.py): what speculation costs when drafts never pay;
* `aerie-spec-fixed-tree`: the same head verifying whole trees every step, as published engines do
  (`--no-adaptive-draft-budget`): what the adaptive budget protects against under load;
* `aerie-ar`: `aerie serve --draft none`; `aerie-ar-twin` the same in a second process, whose
  ratio to `aerie-ar` is the run's own noise floor (two processes of one configuration);
* `aerie-spec-compiled` and `aerie-ar-compiled`: the same with `--enable-torch-compile`;
* `transformers`: the outside reference, `model.generate` on batches of C prompts (left padded,
  `min_new_tokens` = `max_new_tokens`, no `--range-ratio`), throughput only (it is not a server).

The Aerie servers run at once, idle but for the one being measured: each concurrency level runs
against each configuration in turn, so a slow spell of this shared machine hits them alike. Each of
`--rounds` rounds starts the servers afresh (each then serves a short warm-up at the top level),
the order rotating each round (the server that runs first in a round runs slowest,
docs/benchmarks.md). Within a round a level runs as `--slices` slices, each its own requests,
the servers' order reversed every slice (A B, B A, ...): a trial (one slice of one round) pairs
servers that ran back to back, and a level's ratios to AR are taken per trial (their geometric
mean and its 95% bootstrap interval are reported). A level's trials are also pooled; each
records a server's engine seconds by step phase and, speculating, its decode steps and those that
verified drafts (its /metrics, under "counters"). transformers runs after them, in this process.
Results merge into benchmarks/results/serve.json (with the ratios to AR per level) and serve.png.
From the repository root:

    .venv/bin/python benchmarks/bench_serve.py                              # the full sweep
    .venv/bin/python benchmarks/bench_serve.py --concurrency 1,4 --max-tokens 16 \\
        --out /tmp/serve.json                                               # a smoke test
    .venv/bin/python benchmarks/bench_serve.py \\
        --configs aerie-spec,aerie-spec-useless,aerie-ar,aerie-ar-twin --concurrency 1,4,16,32 \\
        --rounds 2 --slices 4 --prompts-per-client 2 --range-ratio 0.5 \\
        --prompts benchmarks/data/dev_set.jsonl --category code \\
        --out benchmarks/results/serve_controller_code_trials.json  # the draft controller, on code
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from random_head import useless_head
from tqdm import tqdm

from engine.execution.model_files import DEFAULT_MODEL, resolve_model_path
from server.serving_benchmark import (
    BenchConfig,
    load_prompts,
    merge_results,
    ratios_to_reference,
    run_benchmark,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
USELESS_HEAD = REPO_ROOT / "runs" / "useless-head"
SERVERS = {
    "aerie-spec": ["--draft", "auto"],
    "aerie-spec-useless": ["--draft", str(USELESS_HEAD)],
    "aerie-spec-fixed-tree": ["--draft", "auto", "--no-adaptive-draft-budget"],
    "aerie-ar": ["--draft", "none"],
    "aerie-ar-twin": ["--draft", "none"],  # a second AR process: the run's own noise floor
    "aerie-spec-compiled": ["--draft", "auto", "--enable-torch-compile"],
    "aerie-ar-compiled": ["--draft", "none", "--enable-torch-compile"],
}
READY_TIMEOUT_S = 1200  # compiling servers start together and share the cores


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if out.exists() and not args.merge:
        out.unlink()  # one run, side by side: no figures from an earlier run
    levels = tuple(int(c) for c in args.concurrency.split(","))
    labels = args.configs.split(",")
    for result in aerie_sweeps(args, levels, [label for label in labels if label in SERVERS]):
        merge_results(out, result)
    if "transformers" in labels:
        merge_results(out, transformers_sweep(args, levels))
    data = json.loads(out.read_text())
    data["ratios_to_ar"] = ratios_to_reference(data["runs"], "aerie-ar")
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data["ratios_to_ar"], indent=2))


def aerie_sweeps(args, levels, labels: list[str]) -> list[dict]:
    """Each of `--rounds` rounds starts every Aerie configuration afresh (idle servers sleep) and
    runs each concurrency level against each in turn, `--slices` times, the order reversed every
    slice: a slow spell of this shared machine hits them alike, and a process that happens to run
    slow (where its memory and threads landed) is one round's, not the whole run's. The order
    rotates each round, so that every configuration runs first (which runs slowest) equally
    often: once in every len(labels) rounds."""
    if "aerie-spec-useless" in labels:
        useless_head(DEFAULT_MODEL, USELESS_HEAD)
    trials = {label: [[] for _ in levels] for label in labels}  # per label, per level: trials
    headers = {}  # per label: its label, model and settings
    for round_index in range(args.rounds):
        shift = round_index % len(labels)
        order = labels[shift:] + labels[:shift]
        with contextlib.ExitStack() as stack:
            urls = {
                label: stack.enter_context(running_server(SERVERS[label], args.extra_server_args))
                for label in order
            }
            for label, url in urls.items():  # warm-up at the top level: a fresh server runs slower
                warm_up = bench_config(args, (max(levels),), url, label)
                run_benchmark(replace(warm_up, num_prompts=max(levels), max_tokens=16))
            for level, concurrency in enumerate(levels):
                for slice_index in range(args.slices):
                    turns = list(urls.items())
                    for label, url in turns if slice_index % 2 == 0 else reversed(turns):
                        config = bench_config(args, (concurrency,), url, label)
                        config = replace(config, first_request=slice_index * config.num_prompts)
                        headers[label], trial = measured_level(config)
                        trials[label][level].append(
                            trial | {"round": round_index, "slice": slice_index}
                        )
    settings = {"concurrency": list(levels), "rounds": args.rounds, "slices": args.slices}
    return [_combined(headers[label], trials[label], settings) for label in labels]


def measured_level(config: BenchConfig) -> tuple[dict, dict]:
    """A one-level run: its label, model and settings; its level's figures, with what the
    server's /metrics counted while it ran."""
    before = server_counters(config.base_url)
    result = run_benchmark(config)
    after = server_counters(config.base_url)
    (level,) = result.pop("levels")
    return result, level | {"counters": {k: v - before.get(k, 0.0) for k, v in after.items()}}


def server_counters(base_url: str) -> dict[str, float]:
    """What a server's /metrics count so far: engine seconds by step phase (propose, verify,
    accept, other) and, for a speculative server, its decode steps and those that verified
    drafts, in all and per batch-size bucket of the draft controller."""
    counters, plain = {}, 0.0
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "aerie_step_phase_seconds_total":
                counters[f"{sample.labels['phase']}_seconds"] = sample.value
            elif sample.name == "aerie_spec_decode_draft_budget_tokens_count":
                counters["decode_steps"] = sample.value
            elif sample.name == "aerie_spec_decode_plain_steps_total":
                plain = sample.value
            elif sample.name == "aerie_spec_decode_steps_by_batch_total":
                counters[f"decode_steps_batch_{sample.labels['batch']}"] = sample.value
            elif sample.name == "aerie_spec_decode_drafting_steps_by_batch_total":
                counters[f"verifying_steps_batch_{sample.labels['batch']}"] = sample.value
    if "decode_steps" in counters:
        counters["verifying_steps"] = counters["decode_steps"] - plain
    return counters


def _combined(header: dict, per_level: list[list[dict]], settings: dict) -> dict:
    """One result per label: each level's trials pooled (tokens and seconds summed, mean
    latencies weighted by requests), with the trials' own figures kept under "trials"."""
    return {
        **header,
        "settings": {**header["settings"], **settings, "first_request": None},
        "levels": [_pooled(trials) for trials in per_level],
    }


def _pooled(trials: list[dict]) -> dict:
    completed = sum(t["completed"] for t in trials)
    seconds = sum(t["duration_s"] for t in trials)
    tokens = sum(t["output_tokens"] for t in trials)
    counters = sorted({k for t in trials for k in t["counters"]})  # a bucket may appear late
    pooled = {
        "concurrency": trials[0]["concurrency"],
        "completed": completed,
        "failed": sum(t["failed"] for t in trials),
        "duration_s": seconds,
        "output_tokens": tokens,
        "request_throughput": completed / seconds,
        "output_throughput": tokens / seconds,
        "counters": {k: sum(t["counters"].get(k, 0.0) for t in trials) for k in counters},
        "trials": trials,
    }
    for name in ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2e_ms"):
        values = [(t[name], t["completed"]) for t in trials if t.get(name) is not None]
        if values:  # p99 ITL: the trials' p99s weighted alike, a summary for the plot
            pooled[name] = sum(v * n for v, n in values) / sum(n for _, n in values)
    return pooled


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", default=str(QUESTIONS), help="JSONL (aerie bench serve's)")
    parser.add_argument("--category", default=None, help="only the prompts of this category")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="per level; 0: max(8, P x C) with P = --prompts-per-client (transformers: 2 x C)",
    )
    parser.add_argument("--prompts-per-client", type=int, default=4)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="Aerie servers: request i asks for max_tokens x (1 +- r), seeded by i",
    )
    parser.add_argument("--rounds", type=int, default=1, help="fresh servers for each round")
    parser.add_argument(
        "--slices",
        type=int,
        default=1,
        help="runs of each level against each server per round, each its own requests",
    )
    everything = [label for label in SERVERS if label != "aerie-ar-twin"] + ["transformers"]
    parser.add_argument("--configs", default=",".join(everything))
    parser.add_argument("--extra-server-args", default="", help="added to every aerie serve")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other configurations' results in --out (rerun some configurations only)",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "serve.json"))
    return parser.parse_args()


def bench_config(args, levels, base_url: str, label: str) -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        prompts=Path(args.prompts),
        category=args.category,
        concurrency=levels,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts or max(8, args.prompts_per_client * max(levels)),
        max_duration=600.0,
        ignore_eos=True,
        range_ratio=args.range_ratio,
        label=label,
    )


class running_server:
    """`aerie serve` on a free port for the duration of a `with` block."""

    def __init__(self, flags: list[str], extra: str) -> None:
        self.flags, self.extra = flags, extra.split()

    def __enter__(self) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-c", "from server.cli import main; main()"]
        command += ["serve", "--port", str(port)]
        (REPO_ROOT / "runs").mkdir(exist_ok=True)
        log = open(REPO_ROOT / "runs" / f"bench-serve-{port}.log", "w")
        self.process = subprocess.Popen(
            [*command, *self.flags, *self.extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"aerie serve exited: see {log.name}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    return base_url
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"aerie serve not ready after {READY_TIMEOUT_S} s: see {log.name}")

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def transformers_sweep(args, levels) -> dict:
    """Batched `generate` throughput: num_prompts prompts per level, in batches of C."""
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    conversations = load_prompts(Path(args.prompts), args.category)
    results = []
    for concurrency in levels:
        total = args.num_prompts or max(8, 2 * concurrency)  # throughput only: fewer suffice
        prompts = [conversations[i % len(conversations)] for i in range(total)]
        tokens, started = 0, time.perf_counter()
        for start in tqdm(range(0, total, concurrency), desc=f"transformers @ batch {concurrency}"):
            batch = prompts[start : start + concurrency]
            texts = [
                tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                for m in batch
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True)
            with torch.no_grad():
                output = model.generate(
                    **inputs,
                    do_sample=False,
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            tokens += (output.shape[1] - inputs["input_ids"].shape[1]) * len(batch)
        elapsed = time.perf_counter() - started
        results.append(
            {
                "concurrency": concurrency,
                "completed": total,
                "duration_s": elapsed,
                "output_tokens": tokens,
                "request_throughput": total / elapsed,
                "output_throughput": tokens / elapsed,
            }
        )
    return {
        "label": "transformers",
        "model": DEFAULT_MODEL,
        "settings": {"batched": True},
        "levels": results,
    }


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
