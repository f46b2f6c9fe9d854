"""Speculation's speed against plain decoding at batch 1, per prompt set, temperature and category.

Each prompt of MT-bench (its 80 first turns) and of the dev set (83 prompts: writing, code,
reasoning) decodes ``--max-tokens`` tokens (EOS ignored) through Aerie without a head (AR) and
with one (the draft controller on, as `aerie serve` runs it), greedy and at temperature 0.7
(seeded: both engines emit the same tokens). The two take turns per prompt, the order flipping
from one prompt to the next, so the machine's drift hits both alike. Reported per set,
temperature and category (and, for the dev set, source: its ShareGPT prompts come from the slice
head training holds out): each engine's tokens/s, speculation's ratio to AR (AR's seconds over its
own, for the same tokens) and the tokens per decode step. Writes ``speedup.json``
(``speedup_TAG.json`` with ``--tag``) and its plot to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_speedup.py                       # ~42 minutes
    .venv/bin/python benchmarks/bench_speedup.py --head PATH --tag round-5
    .venv/bin/python benchmarks/bench_speedup.py --resummarize RESULT.json   # no engine run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from head_training import machine_name
from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "benchmarks" / "data"
PROMPT_SETS = {"mt-bench": DATA / "mt_bench_questions.jsonl", "dev-set": DATA / "dev_set.jsonl"}


def main() -> None:
    args = parse_args()
    if args.resummarize:
        resummarize(args.resummarize)
        return
    engines = {
        name: LLM(DEFAULT_MODEL, draft=draft, kv_cache_memory_gib=0.3)
        for name, draft in (("ar", None), ("eagle", args.head))
    }
    warm_up = engines["ar"].apply_chat_template([{"role": "user", "content": "Hello!"}])
    for llm in engines.values():
        llm.generate([warm_up], SamplingParams(max_tokens=8), use_tqdm=False)
    rows = []
    for set_name in args.sets.split(","):
        records = read_prompts(PROMPT_SETS[set_name])[: args.num_prompts]
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for index, record in enumerate(tqdm(records, desc=f"{set_name}, T={temperature}")):
                params = SamplingParams(
                    temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=index
                )
                row = {"set": set_name, "temperature": temperature, **record}
                order = list(engines) if index % 2 == 0 else list(reversed(engines))
                for name in order:
                    row[name] = timed_generation(engines[name], record["prompt"], params)
                rows.append(row)
    result = {
        "machine": machine_name(),
        "settings": {"model": DEFAULT_MODEL, "head": args.head, "max_tokens": args.max_tokens},
        "summary": summarize(rows),
        "prompts": rows,
    }
    stem = f"speedup_{args.tag}" if args.tag else "speedup"
    write_result(result, args.out_dir / f"{stem}.json")


def write_result(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result["summary"], path.with_suffix(".png"))
    print_summary(result["summary"])


def resummarize(path: Path) -> None:
    """Recompute a result file's summary from its per-prompt rows (the prompts' sources joined
    from the sets' files, for results written before rows carried them), and its plot."""
    result = json.loads(path.read_text())
    sources = {
        (set_name, r["prompt"]): r["source"]
        for set_name, set_path in PROMPT_SETS.items()
        for r in read_prompts(set_path)
        if "source" in r
    }
    for row in result["prompts"]:
        if (row["set"], row["prompt"]) in sources:
            row["source"] = sources[row["set"], row["prompt"]]
    result["summary"] = summarize(result["prompts"])
    write_result(result, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="auto", help="EAGLE head folder ('auto': the shipped)")
    parser.add_argument("--sets", default="mt-bench,dev-set", help=f"of {', '.join(PROMPT_SETS)}")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N of each set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tag", default="", help="write speedup_TAG.json")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--resummarize", type=Path, default=None, help="rewrite a result file's summary and plot"
    )
    args = parser.parse_args()
    unknown = set(args.sets.split(",")) - set(PROMPT_SETS)
    if unknown:
        parser.error(f"unknown prompt sets {sorted(unknown)}; known: {sorted(PROMPT_SETS)}")
    return args


def read_prompts(path: Path) -> list[dict]:
    """{"prompt", "category"[, "source"]} per line: the dev set's records (with their source),
    or MT-bench's first turns."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {
            "prompt": r["prompt"] if "prompt" in r else r["turns"][0],
            "category": r["category"],
            **({"source": r["source"]} if "source" in r else {}),
        }
        for r in records
    ]


def timed_generation(llm: LLM, prompt: str, params: SamplingParams) -> dict:
    """Seconds, new tokens and decode steps of one request, alone in the engine."""
    prompt_ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
    started = time.perf_counter()
    (output,) = llm.generate([prompt_ids], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    completion = output.outputs[0]
    return {
        "seconds": seconds,
        "tokens": len(completion.token_ids),
        "decode_steps": output.metrics.num_decode_steps,
    }


def summarize(rows: list[dict]) -> dict:
    """{set: {temperature: {category, "from SOURCE" or "all": figures}}} over the rows."""
    summary: dict = {}
    for row in rows:
        by_temperature = summary.setdefault(row["set"], {}).setdefault(str(row["temperature"]), {})
        sources = (f"from {row['source']}",) if "source" in row else ()
        for key in (row["category"], *sources, "all"):
            by_temperature.setdefault(key, []).append(row)
    return {
        set_name: {
            temperature: {key: _figures(group) for key, group in sorted(groups.items())}
            for temperature, groups in by_temperature.items()
        }
        for set_name, by_temperature in summary.items()
    }


def _figures(rows: list[dict]) -> dict:
    def total(engine: str, field: str) -> float:
        return sum(r[engine][field] for r in rows)

    ar, eagle = (total(e, "tokens") / total(e, "seconds") for e in ("ar", "eagle"))
    return {
        "prompts": len(rows),
        "ar_tok_s": ar,
        "eagle_tok_s": eagle,
        "vs_ar": eagle / ar,
        # the first token comes from the prefill; every later one from a decode step
        "tokens_per_step": (total("eagle", "tokens") - len(rows)) / total("eagle", "decode_steps"),
    }


def plot(summary: dict, path: Path) -> None:
    """Speculation over AR per category, one panel per prompt set, one bar per temperature."""
    with png_figure(path, ncols=len(summary), figsize=(6 * len(summary), 4.2)) as axes:
        for ax, (set_name, by_temperature) in zip(
            axes if len(summary) > 1 else [axes], summary.items()
        ):
            width = 0.8 / len(by_temperature)
            for shift, (temperature, groups) in enumerate(by_temperature.items()):
                xs = [i + shift * width for i in range(len(groups))]
                ax.bar(xs, [g["vs_ar"] for g in groups.values()], width, label=f"T={temperature}")
                ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups))
            ax.axhline(1.0, color="gray", linestyle="--")
            ax.set(title=set_name, ylabel="speculation / AR (tokens/s)")
            ax.tick_params(axis="x", labelrotation=30)
            ax.legend()


def print_summary(summary: dict) -> None:
    for set_name, by_temperature in summary.items():
        for temperature, groups in by_temperature.items():
            for key, g in groups.items():
                print(
                    f"{set_name:>8} T={temperature:<4} {key:>13} ({g['prompts']:>2}): "
                    f"AR {g['ar_tok_s']:5.1f}, EAGLE {g['eagle_tok_s']:5.1f} tokens/s, "
                    f"{g['vs_ar']:.2f}x, {g['tokens_per_step']:.2f} tokens/step"
                )


if __name__ == "__main__":
    main()
