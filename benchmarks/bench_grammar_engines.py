"""Compare xgrammar and llguidance on this CPU for the work Aerie's constrained speculation needs:
compiling a JSON schema, filling one next-token mask, and walking a draft path then rolling back.

Run: python benchmarks/bench_grammar_engines.py [--model NAME]
(writes benchmarks/results/grammar_engines.json).
xgrammar is not a dependency of Aerie (its wheel requires triton): install it for this comparison
with `pip install --no-deps xgrammar apache-tvm-ffi`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
SAMPLE = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "poetry"],
        "address": {"city": "London", "zip": "W1"},
    }
)


def _timed(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_xgrammar(tokenizer, vocab_size: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    mask_times = []
    for t in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        mask_times.append(time.perf_counter() - start)
        assert matcher.accept_token(t), t
    logits = torch.randn(1, vocab_size)
    apply_s = _timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), 50)
    matcher.reset()

    def walk_and_rollback():
        for t in tokens[:8]:
            matcher.accept_token(t)
        matcher.rollback(8)

    rollback_s = _timed(walk_and_rollback, 50)
    return _summary(compile_s, mask_times, apply_s, rollback_s)


def bench_llguidance(tokenizer, vocab_size: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    mask_times = []
    for t in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        mask_times.append(time.perf_counter() - start)
        assert matcher.consume_token(t), (t, matcher.get_error())
    logits = torch.randn(1, vocab_size)
    apply_s = _timed(lambda: llguidance.torch.apply_token_bitmask_inplace(logits, bitmask), 50)
    matcher.reset()

    def walk_and_rollback():
        for t in tokens[:8]:
            matcher.consume_token(t)
        matcher.rollback(8)

    rollback_s = _timed(walk_and_rollback, 50)
    return _summary(compile_s, mask_times, apply_s, rollback_s)


def _summary(compile_s, mask_times, apply_s, rollback_s) -> dict:
    ordered = sorted(mask_times)
    return {
        "compile_ms": 1000 * compile_s,
        "mask_ms_median": 1000 * ordered[len(ordered) // 2],
        "mask_ms_p90": 1000 * ordered[int(0.9 * len(ordered))],
        "mask_ms_max": 1000 * ordered[-1],
        "apply_mask_ms": 1000 * apply_s,
        "walk8_and_rollback_ms": 1000 * rollback_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", default="benchmarks/results/grammar_engines.json")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    vocab_size = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    tokens = [*tokenizer.encode(SAMPLE), tokenizer.eos_token_id]
    results = {
        "machine": "2-core shared CPU (background job paused)",
        "model": args.model,
        "num_tokens": len(tokens),
        "xgrammar": bench_xgrammar(tokenizer, vocab_size, tokens),
        "llguidance": bench_llguidance(tokenizer, vocab_size, tokens),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
