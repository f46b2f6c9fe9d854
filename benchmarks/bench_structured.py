"""Structured outputs on the default model: the grammar's share of decoding time at 1 and 16
concurrent requests, and constrained speculation against constrained plain decoding at batch 1,
side by side with unconstrained requests, in one run.

Grammar work is every call into the matcher and every mask applied (timed by wrapping those
functions, nested calls counted once). Run from the repository root, with the background job
paused (see RULES): `python benchmarks/bench_structured.py` ->
benchmarks/results/structured.json and structured.png.
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
        for name in ("bitmasks_along", "advance", "rollback"):
            method = getattr(grammar.GrammarMatcher, name)
            setattr(grammar.GrammarMatcher, name, self.wrap(method))
        engine.sampling.sampler.mask_logits = self.wrap(grammar.mask_logits)
        drafting.eagle_drafter.mask_logits = self.wrap(grammar.mask_logits)
        drafting.eagle_drafter.unpack_bitmask = self.wrap(grammar.unpack_bitmask)


def run(llm: LLM, clock: GrammarClock, prompts, structured: bool, max_tokens: int) -> dict:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA)) if structured else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (grammar compiled and cached)
    clock.seconds = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = sum(o.metrics.num_decode_steps for o in outputs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "grammar_seconds": clock.seconds,
        "grammar_share": clock.seconds / seconds,
        "acceptance_length": (tokens - len(outputs)) / max(steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    clock = GrammarClock()
    clock.install()
    results: dict = {"machine": "2-core shared CPU, background job paused", "runs": {}}
    for draft in ("auto", None):
        llm = LLM(draft=draft)
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )
            for q in QUESTIONS
        ]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
        for batch in (1, 16):
            batch_prompts = (prompts * 4)[:batch]
            for structured in (True, False):
                kind = "json_schema" if structured else "free"
                key = f"draft={draft or 'none'} batch={batch} {kind}"
                results["runs"][key] = run(llm, clock, batch_prompts, structured, args.max_tokens)
                print(key, json.dumps(results["runs"][key]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))


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
