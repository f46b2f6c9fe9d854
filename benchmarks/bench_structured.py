"""Structured outputs on the default model: the grammar's share of decoding time at 1 and 16
concurrent requests, and constrained speculation against constrained plain decoding at batch 1,
side by side with unconstrained requests, in one run.

Grammar work is every call into the matcher and every mask applied (timed by wrapping those
functions, nested calls counted once). Batch 1 answers the questions one at a time; batch 16 runs
16 of them at once. Both engines are loaded up front and every configuration runs against both in
turn, `--rounds` times, so a slow spell of this shared machine hits them alike.
Run from the repository root with background jobs paused (SIGSTOP):
`python benchmarks/bench_structured.py` -> benchmarks/results/structured.json and structured.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import drafting.eagle_drafter
import engine.sampling.grammar as grammar
import engine.sampling.sampler
from engine import LLM, SamplingParams
from engine.sampling.grammar import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "skills", "city"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a software engineer from Berlin as JSON.",
    "Give me a JSON profile of a famous painter.",
    "Describe a teacher who lives in Tokyo, in JSON.",
    "Create a JSON record for a football player.",
    "Return a JSON object describing a nurse from Lagos.",
    "Write JSON for a fictional chef and their specialities.",
    "Describe a retired pilot in JSON format.",
    "Output a JSON profile of a young violinist from Vienna.",
    "Give a JSON description of a data scientist who works remotely.",
    "Produce a JSON entry for a marathon runner.",
    "Describe a librarian from Dublin as a JSON object.",
    "Make a JSON record of an architect in Barcelona.",
]


class GrammarClock:
    """Seconds spent in grammar work, nested calls counted once."""

    def __init__(self) -> None:
        self.seconds, self._depth = 0.0, 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        return timed

    def install(self) -> None:
        for name in ("bitmasks_along", "drafts_along", "advance", "rollback"):
            method = getattr(grammar.GrammarMatcher, name)
            setattr(grammar.GrammarMatcher, name, self.wrap(method))
        engine.sampling.sampler.mask_logits = self.wrap(grammar.mask_logits)
        drafting.eagle_drafter.mask_logits = self.wrap(grammar.mask_logits)
        drafting.eagle_drafter.unpack_bitmask = self.wrap(grammar.unpack_bitmask)


def run(llm: LLM, clock: GrammarClock, prompts, batch: int, structured: bool, max_tokens: int):
    """Totals over `prompts` generated `batch` at a time: seconds (also grammar), tokens, steps."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA)) if structured else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (grammar compiled and cached)
    clock.seconds = 0.0
    seconds = tokens = steps = requests = 0
    for start in range(0, len(prompts), batch):
        began = time.perf_counter()
        outputs = llm.generate(prompts[start : start + batch], params, use_tqdm=False)
        seconds += time.perf_counter() - began
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        steps += sum(o.metrics.num_decode_steps for o in outputs)
        requests += len(outputs)
    return {
        "seconds": seconds,
        "grammar_seconds": clock.seconds,
        "tokens": tokens,
        "decode_tokens": tokens - requests,  # the first token of each comes from its prefill
        "decode_steps": steps,
    }


def summarize(totals: dict) -> dict:
    return {
        **totals,
        "tokens_per_second": totals["tokens"] / totals["seconds"],
        "grammar_share": totals["grammar_seconds"] / totals["seconds"],
        "acceptance_length": totals["decode_tokens"] / max(totals["decode_steps"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    clock = GrammarClock()
    clock.install()
    llms = {"auto": LLM(draft="auto"), "none": LLM(draft=None)}
    tokenizer = llms["none"].get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    totals: dict[str, dict] = {}
    for _ in range(args.rounds):
        for batch, batch_prompts in ((1, prompts), (16, (prompts * 2)[:16])):
            for structured in (True, False):
                for draft, llm in llms.items():
                    kind = "json_schema" if structured else "free"
                    key = f"draft={draft} batch={batch} {kind}"
                    run_totals = run(llm, clock, batch_prompts, batch, structured, args.max_tokens)
                    previous = totals.get(key, dict.fromkeys(run_totals, 0))
                    totals[key] = {k: previous[k] + v for k, v in run_totals.items()}
                    print(key, json.dumps(summarize(run_totals)))
    runs = {key: summarize(t) for key, t in totals.items()}
    results = {
        "machine": "2-core shared CPU (AVX2), background jobs paused",
        "command": f"python benchmarks/bench_structured.py --rounds {args.rounds}",
        "runs": runs,
        "targets": targets(runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["targets"], indent=2))
    plot(results, out.with_suffix(".png"))


def targets(runs: dict) -> dict:
    """The issue's figures: grammar share of decoding, and constrained speculation's speed-up and
    acceptance against constrained plain decoding and unconstrained speculation, at batch 1."""
    return {
        "max_grammar_share": max(r["grammar_share"] for k, r in runs.items() if "json" in k),
        "constrained_spec_over_constrained_plain_batch1": runs["draft=auto batch=1 json_schema"][
            "tokens_per_second"
        ]
        / runs["draft=none batch=1 json_schema"]["tokens_per_second"],
        "acceptance_constrained_batch1": runs["draft=auto batch=1 json_schema"][
            "acceptance_length"
        ],
        "acceptance_free_batch1": runs["draft=auto batch=1 free"]["acceptance_length"],
    }


def plot(results: dict, path: Path) -> None:
    from plotting import png_figure

    runs = results["runs"]
    with png_figure(path, ncols=2, figsize=(11, 4.2)) as (share, speed):
        keys = [k for k in runs if "json_schema" in k]
        share.bar(range(len(keys)), [100 * runs[k]["grammar_share"] for k in keys])
        share.set_xticks(
            range(len(keys)), [k.replace(" json_schema", "") for k in keys], rotation=20, fontsize=7
        )
        share.axhline(10, color="red", linestyle="--", label="10% target")
        share.set_ylabel("grammar work, % of decoding time")
        share.legend()
        speed.bar(range(len(runs)), [runs[k]["tokens_per_second"] for k in runs])
        speed.set_xticks(range(len(runs)), list(runs), rotation=30, fontsize=6)
        speed.set_ylabel("tokens / s")


if __name__ == "__main__":
    main()
