"""One EAGLE-3 head file, two engines: Aerie's acceptance length beside vLLM's on the same prompts.

Aerie (engine.LLM) and a vLLM OpenAI server (its CPU build, in its own virtualenv) load the same
head folder and decode the first turns of the first ``--num-prompts`` MT-bench questions through
the model's chat template: greedy, exactly ``--max-tokens`` new tokens (EOS ignored), a chain of 3
drafted tokens (Aerie: draft_top_k=1, draft_depth=3, draft_total_tokens=4, no draft budget; vLLM:
``num_speculative_tokens=3``). vLLM gets the very token ids Aerie's template gives.

Acceptance length is tokens emitted per verifying target pass, the bonus token included. Aerie's:
tokens after the first (which prefill emits) over decode steps. vLLM's: 1 + accepted / drafts from
its Prometheus counters after the run, checked against its ``SpecDecoding metrics: Mean acceptance
length`` log lines (each line covers the interval since the previous one; they are summed here,
weighted by drafts). Also reported: each engine's draft acceptance rate and how many greedy texts
agree. Writes ``vllm_eagle3_interop.json`` and ``.png`` (and vLLM's log as ``.log``), or
``NAME.json`` and so on with ``--name``, to ``--out-dir``. From the repository root, with
background jobs paused:

    python benchmarks/bench_vllm_interop.py ~/.cache/aerie/runs/interop-head/head
    python benchmarks/bench_vllm_interop.py HEAD --vllm-log saved.log   # reuse a server's log
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_engine import machine_info

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
SPECULATIVE_TOKENS = 3
AERIE_CHAIN = dict(draft_top_k=1, draft_depth=SPECULATIVE_TOKENS, draft_total_tokens=4)
SERVED_NAME = "smollm2"
LOG_LINE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: (?P<length>[\d.]+).*?"
    r"Accepted: (?P<accepted>\d+) tokens, Drafted: (?P<drafted>\d+) tokens.*"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", type=Path, help="the EAGLE-3 head folder both engines load")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / "venvs" / "vllm")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--concurrency", type=int, default=16, help="vLLM requests in flight")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--vllm-log", type=Path, help="read this server log instead of running")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="vllm_eagle3_interop", help="the result files' stem")
    args = parser.parse_args()
    head = args.head.expanduser().resolve()
    machine = machine_info()
    aerie = run_aerie(head, args.num_prompts, args.max_tokens)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.name}.json"
    command = vllm_command(args.vllm_venv, head, args.port, args.enforce_eager)
    if args.vllm_log:
        vllm = {"log": summarize_log(args.vllm_log.read_text()), "texts": None}
    else:
        vllm = run_vllm(command, aerie["prompt_ids"], args, out.with_suffix(".log"))
    vllm_length = vllm.get("counters", {}).get("acceptance_length") or vllm["log"]["length"]
    same = None
    if vllm["texts"] is not None:
        same = sum(a == b for a, b in zip(aerie["texts"], vllm["texts"]))
    result = {
        "head": str(head),
        "machine": machine,
        "settings": {
            "model": DEFAULT_MODEL,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "aerie_tree": AERIE_CHAIN,
            "vllm_num_speculative_tokens": SPECULATIVE_TOKENS,
        },
        "commands": {
            "benchmark": " ".join(["python benchmarks/bench_vllm_interop.py", *sys.argv[1:]]),
            "vllm_server": " ".join(command),
            "vllm_env": vllm_env_vars(args.vllm_venv),
        },
        "vllm_version": vllm_version(args.vllm_venv),
        "aerie": {k: v for k, v in aerie.items() if k not in ("texts", "prompt_ids")},
        "vllm": {k: v for k, v in vllm.items() if k != "texts"},
        "vllm_over_aerie": vllm_length / aerie["acceptance_length"],
        "same_greedy_texts": same,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(
        f"acceptance length: Aerie {aerie['acceptance_length']:.3f}, vLLM {vllm_length:.3f} "
        f"(ratio {result['vllm_over_aerie']:.3f}); same greedy texts: {same}; wrote {out}"
    )


def run_aerie(head: Path, num_prompts: int, max_tokens: int) -> dict:
    llm = LLM(DEFAULT_MODEL, draft=str(head), adaptive_draft_budget=False, **AERIE_CHAIN)
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompt_ids = [
        llm.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions[:num_prompts]
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)  # the first is prefill's
    passes = sum(o.metrics.num_decode_steps for o in outputs)
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    return {
        "acceptance_length": tokens / passes,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "decode_passes": passes,
        "tokens_after_first": tokens,
        "seconds": seconds,
        "texts": [o.outputs[0].text for o in outputs],
        "prompt_ids": prompt_ids,
    }


def vllm_command(venv: Path, head: Path, port: int, enforce_eager: bool) -> list[str]:
    cache = Path(os.environ.get("AERIE_CACHE", Path.home() / ".cache" / "aerie"))
    speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cache / DEFAULT_MODEL),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--speculative-config",
        json.dumps(speculative),
    ]
    return command + (["--enforce-eager"] if enforce_eager else [])


def vllm_env_vars(venv: Path) -> dict[str, str]:
    """The CPU build's documented set-up (../shared/peers/vllm-cpu.md)."""
    return {
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_TARGET_DEVICE": "cpu",
    }


def vllm_version(venv: Path) -> str | None:
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip().splitlines()[-1] if found.returncode == 0 else None


def run_vllm(command: list[str], prompt_ids: list[list[int]], args, log_path: Path) -> dict:
    """Start the server, send every prompt, read its counters, stop it; its log goes to log_path."""
    env = {**os.environ, **vllm_env_vars(args.vllm_venv)}
    env.pop("PYTHONPATH", None)  # Aerie's worktree must not shadow vLLM's packages
    base = f"http://127.0.0.1:{args.port}"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(base, server, log_path)
            body = dict(
                model=SERVED_NAME,
                max_tokens=args.max_tokens,
                temperature=0,
                ignore_eos=True,
            )
            with ThreadPoolExecutor(args.concurrency) as pool:
                texts = list(
                    pool.map(lambda ids: complete(base, {**body, "prompt": ids}), prompt_ids)
                )
            counters = spec_counters(http_get(base + "/metrics"))
            time.sleep(12)  # the next 10-second stats line covers the last requests
        finally:
            server.terminate()
            server.wait(timeout=60)
    return {"counters": counters, "log": summarize_log(log_path.read_text()), "texts": texts}


def wait_until_healthy(base: str, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.returncode}; see {log_path}")
        try:
            http_get(base + "/health")
            return
        except OSError:
            time.sleep(5)
    raise RuntimeError(f"vLLM did not become healthy in 30 minutes; see {log_path}")


def complete(base: str, body: dict) -> str:
    request = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())["choices"][0]["text"]


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def spec_counters(metrics: str) -> dict:
    """vLLM's cumulative speculative-decoding counters and the acceptance length they give."""

    def total(name: str) -> float:
        pattern = rf"^vllm:{name}_total(?:{{[^}}]*}})? ([\d.e+]+)$"
        return sum(float(v) for v in re.findall(pattern, metrics, re.MULTILINE))

    drafts, drafted = total("spec_decode_num_drafts"), total("spec_decode_num_draft_tokens")
    accepted = total("spec_decode_num_accepted_tokens")
    per_position = [
        float(v) / drafts if drafts else None
        for _, v in sorted(
            re.findall(
                r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{[^}]*position="(\d+)"[^}]*}'
                r" ([\d.e+]+)$",
                metrics,
                re.MULTILINE,
            ),
            key=lambda pair: int(pair[0]),
        )
    ]
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "per_position_acceptance_rate": per_position,
    }


def summarize_log(log: str) -> dict:
    """The `SpecDecoding metrics` lines: each interval's figure, and all of them together."""
    lines = [m for m in LOG_LINE.finditer(log)]
    accepted = sum(int(m["accepted"]) for m in lines)
    drafted = sum(int(m["drafted"]) for m in lines)
    drafts = drafted / SPECULATIVE_TOKENS
    return {
        "lines": [m.group(0) for m in lines],
        "interval_lengths": [float(m["length"]) for m in lines],
        "length": 1 + accepted / drafts if drafts else None,
        "accepted_tokens": accepted,
        "draft_tokens": drafted,
    }


def plot(result: dict, path: Path) -> None:
    with png_figure(path, figsize=(5, 4)) as axes:
        aerie = result["aerie"]["acceptance_length"]
        vllm = aerie * result["vllm_over_aerie"]
        bars = axes.bar(["Aerie", f"vLLM {result['vllm_version']}"], [aerie, vllm])
        axes.bar_label(bars, fmt="%.2f")
        axes.set_ylabel("acceptance length (tokens per verify pass)")
        settings = result["settings"]
        axes.set_title(
            f"one EAGLE-3 head, {settings['num_prompts']} MT-bench prompts, "
            f"{SPECULATIVE_TOKENS} drafted",
            fontsize=9,
        )
        axes.grid(axis="y", alpha=0.3)


if __name__ == "__main__":
    main()
