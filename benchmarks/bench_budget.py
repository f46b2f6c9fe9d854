"""Does the draft controller choose well when to draft? AR, the controller, and drafting always.

Batch 1, the first turns of the first ``--num-prompts`` MT-bench questions, greedy, ``--max-tokens``
new tokens (EOS ignored), four engines interleaved per prompt so that the machine's drift hits
all alike: plain AR; EAGLE with the draft controller and per-request pauses (the default); EAGLE
drafting at every step, the budget still choosing each step's nodes (the controller's choice
fixed to drafting, no request paused); EAGLE verifying whole trees. With ``--useless-head`` the
EAGLE engines load a head of the shipped head's shape with random weights (its drafts are never
accepted), where the controller should cost next to nothing over AR. Writes ``budget.json`` to
``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_budget.py --num-prompts 16    # ~4 minutes
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from random_head import useless_head
from tqdm import tqdm

from drafting.shipped_heads import shipped_head
from engine import LLM, SamplingParams
from engine.execution.model_files import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"


def engines(head: str) -> dict[str, LLM]:
    small_pool = dict(kv_cache_memory_gib=0.3)
    always = LLM(DEFAULT_MODEL, draft=head, **small_pool)
    always.engine.policy.controller.choose = lambda num_decoding: True
    always.engine.policy.evidence.may_draft = lambda seq: True
    return {
        "ar": LLM(DEFAULT_MODEL, draft=None, **small_pool),
        "controller": LLM(DEFAULT_MODEL, draft=head, **small_pool),
        "drafting every step": always,
        "whole trees": LLM(DEFAULT_MODEL, draft=head, adaptive_draft_budget=False, **small_pool),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--useless-head", action="store_true", help="random head weights")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    scratch = tempfile.TemporaryDirectory()
    head = (
        useless_head(DEFAULT_MODEL, Path(scratch.name))
        if args.useless_head
        else shipped_head(DEFAULT_MODEL)
    )
    llms = engines(str(head))
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [
        llms["ar"].apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions[: args.num_prompts]
    ]
    seconds, tokens = dict.fromkeys(llms, 0.0), dict.fromkeys(llms, 0)
    for prompt in tqdm(prompts, desc="prompts"):
        for name, llm in llms.items():
            started = time.perf_counter()
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            seconds[name] += time.perf_counter() - started
            tokens[name] += len(output.outputs[0].token_ids)
    results = {
        name: {
            "tok_s": tokens[name] / seconds[name],
            "vs_ar": seconds["ar"] / seconds[name] * tokens[name] / tokens["ar"],
        }
        for name in llms
    }
    for name, result in results.items():
        print(f"{name:>20}: {result['tok_s']:.1f} tokens/s, {result['vs_ar']:.3f}x AR")
    settings = {
        "model": DEFAULT_MODEL,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "head": "useless (random weights)" if args.useless_head else "shipped",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / ("budget_useless-head.json" if args.useless_head else "budget.json")
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
