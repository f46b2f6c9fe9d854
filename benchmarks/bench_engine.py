"""Aerie's decode speed, plain (AR) and speculative, against Hugging Face transformers.

What it measures, in one run on the default model (smollm2-135m-instruct, fp32):

* batch 1: the first turns of the first ``--num-prompts`` MT-bench questions (81, 82, ...), each
  through the model's chat template, greedy, ``--max-tokens`` new tokens, through
  (a) Aerie without a draft head (``LLM(draft=None)``) and (b) transformers'
  ``model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` on the same fp32 weights
  (the folder Aerie converted). The two run interleaved per prompt (Aerie, transformers, Aerie,
  ...) so machine noise hits both alike, after one warm-up generation each. Reported: tokens/s
  per prompt and overall (total new tokens / total wall time, prefill included), the ratio
  Aerie / transformers, and how many prompts got identical greedy tokens from both.
* batch N (``--batch``, default 16): Aerie's aggregate output tokens/s with the first N prompts
  submitted in one ``generate`` call, and its ratio to Aerie's batch-1 tokens/s; the engines
  take turns for ``--batch-rounds`` rounds (default 3), and the figures sum the rounds.
* with ``--torch-compile``, a compiled column: Aerie AR with ``enable_torch_compile=True`` (its
  start-up compiles for minutes first), beside the others in the same loops.
* with ``--draft HEAD`` (default: the head shipped for the model, if any), a speculative column:
  Aerie with that EAGLE head runs beside AR in the same interleaved loop and batch runs, reporting
  tokens/s, the mean acceptance length (tokens emitted per target pass, bonus included) and the
  mean time per step in each phase (propose, verify, accept).

By default every request decodes exactly ``--max-tokens`` tokens (``--ignore-eos``): Aerie bans EOS
for all of them (``SamplingParams(min_tokens=max_tokens)``) and transformers gets
``min_new_tokens=max_tokens``, the same rule, so the greedy outputs stay comparable. (Aerie's
``ignore_eos=True`` alone would let greedy emit EOS and decode on, which transformers'
``min_new_tokens`` forbids.) ``--no-ignore-eos`` lets both stop at EOS.

Prefix caching is off by default (``--prefix-caching`` turns it on) so that Aerie reuses no
prefill work that transformers has to do, and the batch run does not reuse the batch-1 prompts.

Writes ``engine.json`` (machine, settings, per-prompt figures, summary) and ``engine.png``
(bar chart) to ``--out-dir`` (default benchmarks/results). Run from the repository root:

    .venv/bin/python benchmarks/bench_engine.py                  # the full benchmark
    .venv/bin/python benchmarks/bench_engine.py --num-prompts 2 --max-tokens 16 --batch 4 \\
        --out-dir /tmp/bench_smoke                              # a quick smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL, resolve_model_path
from engine.spec.draft_method import resolve_draft
from engine.stats import StepStats

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
WARMUP_PROMPT = "Say hello and introduce yourself in two sentences."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=20, help="batch-1 prompts (from Q81)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=16, help="requests in the batched run")
    parser.add_argument(
        "--batch-rounds",
        type=int,
        default=3,
        help="batched runs per engine, the engines alternating (this machine's speed drifts)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results", help="output folder"
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode exactly --max-tokens tokens per request, never stopping at EOS",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Aerie's prefix cache (off by default: transformers has none)",
    )
    parser.add_argument(
        "--draft",
        default="auto",
        help="EAGLE head for the speculative column ('auto': the shipped head; "
        "'none': no speculative column)",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="also run Aerie AR with enable_torch_compile=True (minutes of start-up)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="device for both (cpu, cuda, cuda:N)")
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.batch, args.batch_rounds) < 1:
        parser.error("--num-prompts, --max-tokens, --batch and --batch-rounds must be >= 1")
    return args


def load_first_turns(count: int) -> list[dict]:
    """The first `count` MT-bench questions as {question_id, category, text} (first turn)."""
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    if count > len(questions):
        raise SystemExit(f"{QUESTIONS} holds {len(questions)} questions, {count} asked for")
    return [
        {"question_id": q["question_id"], "category": q["category"], "text": q["turns"][0]}
        for q in questions[:count]
    ]


def machine_info() -> dict:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15_at_start": list(os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def aerie_params(args: argparse.Namespace) -> SamplingParams:
    # min_tokens bans EOS, the exact counterpart of transformers' min_new_tokens.
    min_tokens = args.max_tokens if args.ignore_eos else 0
    return SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=min_tokens)


def load_hf_model(device: str):
    path = resolve_model_path(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


class PhaseTimes:
    """Sums the engine's per-step timings (a stats listener), over all decode steps and over those
    that verified drafts (the rest, under the adaptive budget, are plain steps)."""

    def __init__(self) -> None:
        self.steps = {"all": 0, "drafting": 0}
        self.seconds = {kind: {"propose": 0.0, "verify": 0.0, "accept": 0.0} for kind in self.steps}

    def __call__(self, stats: StepStats) -> None:
        for kind in ("all", "drafting") if stats.num_drafts else ("all",):
            self.steps[kind] += 1
            self.seconds[kind]["propose"] += stats.propose_time_s
            self.seconds[kind]["verify"] += stats.verify_time_s
            self.seconds[kind]["accept"] += stats.accept_time_s

    def mean_ms(self) -> dict[str, dict[str, float]]:
        """Per kind of step: mean ms in each phase, and how many such steps there were."""
        return {
            f"{kind}_steps": {
                "steps": self.steps[kind],
                **{k: 1000 * v / max(self.steps[kind], 1) for k, v in self.seconds[kind].items()},
            }
            for kind in self.steps
        }


def run_aerie(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    """Generate all prompts in one call; returns (outputs, wall seconds)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def acceptance_length(outputs) -> float:
    """Tokens emitted per target pass after prefill, the bonus token included."""
    emitted = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    return emitted / max(1, sum(o.metrics.num_decode_steps for o in outputs))


def run_hf(model, prompt: list[int], args: argparse.Namespace, eos_id: int) -> tuple[list, float]:
    """One greedy transformers generation; returns (new token ids, wall seconds)."""
    input_ids = torch.tensor([prompt], device=args.device)
    extra = {"min_new_tokens": args.max_tokens} if args.ignore_eos else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=args.max_tokens,
            pad_token_id=eos_id,
            **extra,
        )
    tokens = out[0, len(prompt) :].tolist()  # .tolist() also waits for a GPU
    return tokens, time.perf_counter() - start


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_batch1(llms: dict[str, LLM], model, prompts, questions, args, eos_id) -> list[dict]:
    """Interleaved batch-1 runs (each Aerie configuration, then transformers) after warm-ups."""
    params = aerie_params(args)
    warmup = llms["aerie"].apply_chat_template([{"role": "user", "content": WARMUP_PROMPT}])
    for llm in llms.values():
        run_aerie(llm, [warmup], params)
    run_hf(model, warmup, args, eos_id)
    rows = []
    for question, prompt in tqdm(list(zip(questions, prompts)), desc="batch 1", unit="prompt"):
        row = {
            "question_id": question["question_id"],
            "category": question["category"],
            "prompt_tokens": len(prompt),
        }
        for name, llm in llms.items():
            (output,), seconds = run_aerie(llm, [prompt], params)
            tokens = list(output.outputs[0].token_ids)
            row.update(
                {
                    f"{name}_tokens": len(tokens),
                    f"{name}_seconds": seconds,
                    f"{name}_tok_s": len(tokens) / seconds,
                    f"{name}_token_ids": tokens,
                    f"{name}_acceptance_length": acceptance_length([output]),
                }
            )
        hf_tokens, hf_s = run_hf(model, prompt, args, eos_id)
        mismatch = first_mismatch(row["aerie_token_ids"], hf_tokens)
        row.update(
            {
                "hf_tokens": len(hf_tokens),
                "hf_seconds": hf_s,
                "hf_tok_s": len(hf_tokens) / hf_s,
                "aerie_over_hf": row["aerie_tok_s"] / (len(hf_tokens) / hf_s),
                "identical": mismatch is None,
                "first_mismatch_index": mismatch,
            }
        )
        for name in ("spec", "compiled"):
            if name in llms:
                same = row[f"{name}_token_ids"] == row["aerie_token_ids"]
                row[f"{name}_identical_to_aerie"] = same
        rows.append(row)
    return rows


def bench_batches(llms: dict[str, LLM], prompts, args) -> dict[str, dict]:
    """All `prompts` submitted in one generate call per engine, the engines taking turns for
    `args.batch_rounds` rounds: aggregate output tokens/s over the rounds, per engine."""
    runs: dict[str, list] = {name: [] for name in llms}
    total = args.batch_rounds * len(llms)
    with tqdm(total=total, desc=f"batch {len(prompts)}", unit="run") as bar:
        for _ in range(args.batch_rounds):
            for name, llm in llms.items():
                runs[name].append(run_aerie(llm, prompts, aerie_params(args)))
                bar.update()
    return {name: batch_result(engine_runs) for name, engine_runs in runs.items()}


def batch_result(runs: list[tuple[list, float]]) -> dict:
    """One engine's batched runs, (outputs, seconds) each, summed."""
    outputs = [o for run_outputs, _ in runs for o in run_outputs]
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    seconds = sum(s for _, s in runs)
    return {
        "num_requests": len(runs[0][0]),
        "rounds": len(runs),
        "total_tokens": total,
        "seconds": seconds,
        "tok_s": total / seconds,
        "round_tok_s": [sum(len(o.outputs[0].token_ids) for o in outs) / s for outs, s in runs],
        "acceptance_length": acceptance_length(outputs),
        "token_ids": [list(o.outputs[0].token_ids) for o in runs[0][0]],
    }


def summarize(
    rows: list[dict], batches: dict[str, dict], phases: dict[str, dict[str, PhaseTimes]]
) -> dict:
    def tok_s(name: str) -> float:
        return sum(r[f"{name}_tokens"] for r in rows) / sum(r[f"{name}_seconds"] for r in rows)

    summary = {
        "hf_batch1_tok_s": tok_s("hf"),
        "aerie_batch1_tok_s": tok_s("aerie"),
        "aerie_over_hf_batch1": tok_s("aerie") / tok_s("hf"),
        "identical_outputs": sum(r["identical"] for r in rows),
        "num_prompts": len(rows),
        "batch": batches["aerie"]["num_requests"],
        "aerie_batch_tok_s": batches["aerie"]["tok_s"],
        "aerie_batch_over_batch1": batches["aerie"]["tok_s"] / tok_s("aerie"),
        # does batching change Aerie's greedy output? (prompts that also ran at batch 1)
        "batch_outputs_equal_batch1": sum(
            r["aerie_token_ids"] == t for r, t in zip(rows, batches["aerie"]["token_ids"])
        ),
        "batch_outputs_compared": min(len(rows), len(batches["aerie"]["token_ids"])),
        # per batch size, per engine: mean ms per phase over all decode steps and drafting ones
        "phase_ms_per_step": {
            size: {name: p.mean_ms() for name, p in by_engine.items()}
            for size, by_engine in phases.items()
        },
    }
    if "compiled" in batches:
        summary.update(
            {
                "compiled_batch1_tok_s": tok_s("compiled"),
                "compiled_over_hf_batch1": tok_s("compiled") / tok_s("hf"),
                "compiled_over_aerie_batch1": tok_s("compiled") / tok_s("aerie"),
                "compiled_identical_to_aerie": sum(r["compiled_identical_to_aerie"] for r in rows),
                "compiled_batch_tok_s": batches["compiled"]["tok_s"],
                "compiled_over_aerie_batch": batches["compiled"]["tok_s"]
                / batches["aerie"]["tok_s"],
            }
        )
    if "spec" in batches:
        summary.update(
            {
                "spec_batch1_tok_s": tok_s("spec"),
                "spec_over_aerie_batch1": tok_s("spec") / tok_s("aerie"),
                "spec_over_hf_batch1": tok_s("spec") / tok_s("hf"),
                "spec_acceptance_length_batch1": sum(r["spec_tokens"] - 1 for r in rows)
                / sum((r["spec_tokens"] - 1) / r["spec_acceptance_length"] for r in rows),
                "spec_identical_to_aerie": sum(r["spec_identical_to_aerie"] for r in rows),
                "spec_batch_tok_s": batches["spec"]["tok_s"],
                "spec_over_aerie_batch": batches["spec"]["tok_s"] / batches["aerie"]["tok_s"],
                "spec_acceptance_length_batch": batches["spec"]["acceptance_length"],
            }
        )
    return summary


def print_summary(rows: list[dict], summary: dict) -> None:
    spec = "spec_batch1_tok_s" in summary
    print(
        f"\n{'qid':>4} {'prompt':>6} {'aerie tok/s':>11} {'hf tok/s':>9} {'ratio':>6}  same"
        + ("  spec tok/s  accept" if spec else "")
    )
    for r in rows:
        line = (
            f"{r['question_id']:>4} {r['prompt_tokens']:>6} {r['aerie_tok_s']:>11.1f} "
            f"{r['hf_tok_s']:>9.1f} {r['aerie_over_hf']:>6.2f}  "
            f"{'yes' if r['identical'] else 'no ':>4}"
        )
        if spec:
            line += f"  {r['spec_tok_s']:>10.1f}  {r['spec_acceptance_length']:>6.2f}"
        print(line)
    s = summary
    print(
        f"\nbatch 1: Aerie {s['aerie_batch1_tok_s']:.1f} tok/s, transformers "
        f"{s['hf_batch1_tok_s']:.1f} tok/s, Aerie/transformers {s['aerie_over_hf_batch1']:.2f}x"
    )
    print(
        f"identical greedy outputs (Aerie vs transformers): "
        f"{s['identical_outputs']}/{s['num_prompts']}"
    )
    print(
        f"batch {s['batch']}: Aerie {s['aerie_batch_tok_s']:.1f} tok/s aggregate, "
        f"{s['aerie_batch_over_batch1']:.2f}x Aerie batch 1 (outputs equal to batch 1: "
        f"{s['batch_outputs_equal_batch1']}/{s['batch_outputs_compared']})"
    )
    if spec:
        print(
            f"speculative batch 1: {s['spec_batch1_tok_s']:.1f} tok/s, "
            f"{s['spec_over_aerie_batch1']:.2f}x AR, {s['spec_over_hf_batch1']:.2f}x "
            f"transformers, acceptance length {s['spec_acceptance_length_batch1']:.2f}, "
            f"identical to AR {s['spec_identical_to_aerie']}/{s['num_prompts']}"
        )
        print(
            f"speculative batch {s['batch']}: {s['spec_batch_tok_s']:.1f} tok/s, "
            f"{s['spec_over_aerie_batch']:.2f}x AR, acceptance length "
            f"{s['spec_acceptance_length_batch']:.2f}"
        )
    if "compiled_batch1_tok_s" in s:
        print(
            f"compiled AR batch 1: {s['compiled_batch1_tok_s']:.1f} tok/s, "
            f"{s['compiled_over_hf_batch1']:.2f}x transformers, "
            f"{s['compiled_over_aerie_batch1']:.2f}x eager AR, identical to eager AR "
            f"{s['compiled_identical_to_aerie']}/{s['num_prompts']}; batch {s['batch']}: "
            f"{s['compiled_batch_tok_s']:.1f} tok/s, {s['compiled_over_aerie_batch']:.2f}x eager"
        )
    for size, by_engine in s["phase_ms_per_step"].items():
        for name, kinds in by_engine.items():
            for kind, phases in kinds.items():
                figures = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "steps")
                print(f"{size} {name}, {phases['steps']} {kind}: ms per step {figures}")


def plot(summary: dict, machine: dict, settings: dict, path: Path) -> None:
    s = summary
    labels = ["transformers\nbatch 1", "Aerie AR\nbatch 1", f"Aerie AR\nbatch {s['batch']}"]
    values = [s["hf_batch1_tok_s"], s["aerie_batch1_tok_s"], s["aerie_batch_tok_s"]]
    notes = [
        "",
        f"{s['aerie_over_hf_batch1']:.2f}x transformers",
        f"{s['aerie_batch_over_batch1']:.2f}x AR batch 1",
    ]
    if "compiled_batch1_tok_s" in s:
        labels += ["Aerie AR\ncompiled, batch 1", f"Aerie AR\ncompiled, batch {s['batch']}"]
        values += [s["compiled_batch1_tok_s"], s["compiled_batch_tok_s"]]
        notes += [
            f"{s['compiled_over_hf_batch1']:.2f}x transformers",
            f"{s['compiled_over_aerie_batch']:.2f}x eager AR",
        ]
    if "spec_batch1_tok_s" in s:
        labels += ["Aerie EAGLE\nbatch 1", f"Aerie EAGLE\nbatch {s['batch']}"]
        values += [s["spec_batch1_tok_s"], s["spec_batch_tok_s"]]
        notes += [
            f"{s['spec_over_aerie_batch1']:.2f}x AR\naccept "
            f"{s['spec_acceptance_length_batch1']:.2f}",
            f"{s['spec_over_aerie_batch']:.2f}x AR\naccept {s['spec_acceptance_length_batch']:.2f}",
        ]
    with png_figure(path, figsize=(1.8 * len(values) + 1.8, 4.8)) as ax:
        colors = ["#9e9e9e", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#2ca02c", "#d62728"]
        bars = ax.bar(labels, values, color=colors[: len(values)])
        for bar, value, note in zip(bars, values, notes):
            text = f"{value:.1f} tok/s" + (f"\n{note}" if note else "")
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=9,
            )
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, max(values) * 1.25)
        ax.set_title(
            f"{DEFAULT_MODEL} fp32, greedy, {settings['max_tokens']} new tokens, "
            f"{s['num_prompts']} MT-bench prompts\n"
            f"{machine['cpu_model']}, {machine['torch_threads']} threads; "
            f"identical outputs {s['identical_outputs']}/{s['num_prompts']}",
            fontsize=9,
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    questions = load_first_turns(max(args.num_prompts, args.batch))
    options = dict(
        device=args.device,
        dtype="float32",
        enable_prefix_caching=args.prefix_caching,
        max_num_seqs=max(64, args.batch),
    )
    llms = {"aerie": LLM(model=DEFAULT_MODEL, draft=None, **options)}
    if args.torch_compile:
        llms["compiled"] = LLM(
            model=DEFAULT_MODEL, draft=None, enable_torch_compile=True, **options
        )
    draft = resolve_draft(DEFAULT_MODEL, args.draft)
    if draft:
        llms["spec"] = LLM(model=DEFAULT_MODEL, draft=draft, **options)
    phases = {size: {name: PhaseTimes() for name in llms} for size in ("batch1", "batch")}
    model = load_hf_model(args.device)
    eos_id = llms["aerie"].get_tokenizer().eos_token_id
    prompts = [
        llms["aerie"].apply_chat_template([{"role": "user", "content": q["text"]}])
        for q in questions
    ]

    for name, llm in llms.items():
        llm.engine.stats_listeners[:] = [phases["batch1"][name]]
    rows = bench_batch1(
        llms, model, prompts[: args.num_prompts], questions[: args.num_prompts], args, eos_id
    )
    for name, llm in llms.items():
        llm.engine.stats_listeners[:] = [phases["batch"][name]]
    batches = bench_batches(llms, prompts[: args.batch], args)
    summary = summarize(rows, batches, phases)

    machine["load_average_1_5_15_at_end"] = list(os.getloadavg())
    settings = {
        "model": DEFAULT_MODEL,
        "model_path": str(resolve_model_path(DEFAULT_MODEL)),
        "dtype": "float32",
        "device": args.device,
        "num_prompts": args.num_prompts,
        "question_ids": [q["question_id"] for q in questions[: args.num_prompts]],
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "batch_rounds": args.batch_rounds,
        "ignore_eos": args.ignore_eos,
        "greedy": True,
        "prefix_caching": args.prefix_caching,
        "draft": draft,
        "compiled": "LLM(draft=None, enable_torch_compile=True)" if args.torch_compile else None,
        "aerie": "LLM(draft=None), SamplingParams(temperature=0, max_tokens=N"
        + (", min_tokens=N)" if args.ignore_eos else ")"),
        "transformers": "model.generate(do_sample=False, max_new_tokens=N"
        + (", min_new_tokens=N)" if args.ignore_eos else ")"),
        "timing": "wall clock per generate call, prefill included; order A, T, A, T, ...",
    }
    for r in rows:
        for name in llms:
            del r[f"{name}_token_ids"]
    for batch in batches.values():
        del batch["token_ids"]
    result = {
        "machine": machine,
        "settings": settings,
        "batch1": rows,
        "batched": batches,
        "summary": summary,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(summary, machine, settings, args.out_dir / "engine.png")
    print_summary(rows, summary)
    print(f"\nwrote {args.out_dir / 'engine.json'} and {args.out_dir / 'engine.png'}")


if __name__ == "__main__":
    main()
