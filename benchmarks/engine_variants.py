"""Engine variants side by side: the same requests on each, the engines stepped in turns.

A helper of the benchmarks that weigh one engine option (bench_draft_weights.py,
bench_padded_passes.py). The engines live in one process and take turns one engine step at a
time (bench_load_overhead.py's rounds), so the machine's drift hits all alike. At each batch size
B, `rounds` rounds of B requests started together (MT-bench first turns, greedy, `max_tokens`
new tokens, EOS banned), each round on the next B questions. Per batch size and engine: output
tokens/s and its ratio to the first engine's, the mean decode step and its propose (drafting)
phase, the steps that verified drafts, their mean acceptance length, and whether the outputs
equal the first engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL

from bench_load_overhead import run_round, summarize
from plotting import png_figure

QUESTIONS = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"


def compare_variants(
    engines: dict[str, dict],
    batches: list[int],
    rounds: list[int],
    max_tokens: int,
    out: Path,
    title: str,
) -> list[dict]:
    """Run every engine (name -> LLM options beside the model's; the first is the reference) at
    each batch size; write the results to `out` (JSON) and a plot beside it (PNG)."""
    options = dict(max_num_seqs=max(64, *batches), kv_cache_memory_gib=1.0)
    llms = {name: LLM(DEFAULT_MODEL, **engine, **options) for name, engine in engines.items()}
    reference = next(iter(llms))
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [
        llms[reference].apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
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
            row[name] = summarize(engine_runs, batch)
            row[name]["acceptance_length"] = acceptance_length(engine_runs)
            row[name]["vs_reference"] = row[name]["tok_s"] / row[reference]["tok_s"]
            row[name]["same_outputs"] = all(
                r[name].token_ids == r[reference].token_ids for r in runs
            )
        results.append(row)
        print(f"batch {batch}: " + "; ".join(_line(name, row[name]) for name in llms))
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"model": DEFAULT_MODEL, "max_tokens": max_tokens, "reference": reference, **options}
    settings["engines"] = engines
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, list(llms), title, out.with_suffix(".png"))
    print(f"wrote {out}")
    return results


def acceptance_length(runs) -> float | None:
    """Tokens per target pass of the sequences that verified drafts (the bonus included)."""
    stats = [stats for run in runs for _, stats in run.steps]
    drafts = sum(s.num_drafts for s in stats)
    return sum(sum(s.tokens_per_pass) for s in stats) / drafts if drafts else None


def _line(name: str, result: dict) -> str:
    acceptance = result["acceptance_length"]
    return (
        f"{name} {result['tok_s']:.1f} tok/s ({result['vs_reference']:.3f}x), decode step"
        f" {result['decode_step_ms']:.2f} ms, propose {result['propose_ms']:.2f} ms, acceptance"
        f" {'-' if acceptance is None else f'{acceptance:.2f}'}"
        f"{'' if result['same_outputs'] else ', OUTPUTS DIFFER'}"
    )


def plot(results: list[dict], names: list[str], title: str, path: Path) -> None:
    with png_figure(path) as axes:
        batches = [r["batch"] for r in results]
        for name in names[1:]:
            axes.plot(batches, [r[name]["vs_reference"] for r in results], "o-", label=name)
        axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("requests decoding at once")
        axes.set_ylabel(f"tokens/s over {names[0]}'s")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
