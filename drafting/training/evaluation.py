"""A head's acceptance length on the dev set, per category and tree shape: whole trees verified
every step (no draft budget), greedy, so the figure is the head's, not the budget's."""

from __future__ import annotations

from pathlib import Path

from drafting.eagle_drafter import TreeShape
from drafting.training.dev_set import CATEGORIES
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams

DEFAULT_TREE = TreeShape(
    EngineConfig.draft_top_k, EngineConfig.draft_depth, EngineConfig.draft_total_tokens
)
LARGE_TREE = TreeShape(8, 6, 32)


def shape_name(shape: TreeShape) -> str:
    return f"{shape.top_k}x{shape.depth}/{shape.total_tokens}"


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
        results[shape_name(shape)] = {k: t / p for k, (t, p) in by_category.items() if p}
    return results
