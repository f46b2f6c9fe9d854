"""A head's acceptance length on the dev set, per category and tree shape: whole trees verified
every step (no draft budget), greedy, so the figure is the head's, not the budget's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from drafting.training.dev_set import CATEGORIES
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class TreeShape:
    top_k: int
    depth: int
    total_tokens: int

    @property
    def name(self) -> str:
        return f"{self.top_k}x{self.depth}/{self.total_tokens}"


DEFAULT_TREE = TreeShape(4, 2, 4)  # the engine's default (engine/config.py)
LARGE_TREE = TreeShape(8, 6, 32)


def acceptance_lengths(
    target: str,
    head: str | Path,
    dev_set: list[dict],
    shapes: tuple[TreeShape, ...] = (DEFAULT_TREE, LARGE_TREE),
    max_tokens: int = 128,
) -> dict[str, dict[str, float]]:
    """{shape name: {category: tokens per verify pass (bonus included), "all": every prompt}}."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results = {}
    for shape in shapes:
        llm = LLM(
            target,
            draft=str(head),
            adaptive_draft_budget=False,
            draft_top_k=shape.top_k,
            draft_depth=shape.depth,
            draft_total_tokens=shape.total_tokens,
        )
        prompts = [
            llm.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in dev_set
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        by_category: dict[str, list[int]] = {c: [0, 0] for c in (*CATEGORIES, "all")}
        for record, output in zip(dev_set, outputs):
            tokens = len(output.outputs[0].token_ids) - 1  # the first comes from the prefill
            for key in (record["category"], "all"):
                by_category[key][0] += tokens
                by_category[key][1] += output.metrics.num_decode_steps
        results[shape.name] = {k: t / p for k, (t, p) in by_category.items() if p}
    return results
