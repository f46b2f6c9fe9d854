"""How much of the target's greedy output a reduced draft vocabulary can propose at all.

A head with a reduced draft vocabulary cannot draft a token outside it: where the target's greedy
token lies outside, the draft path ends there, whatever the head learnt. This takes the
vocabularies `train-head --draft-vocab-size N` would choose (the N most frequent answer tokens of
ShareGPT's first training conversations), and measures the share of the target's greedy answer
tokens on the dev set (128 tokens a prompt) that each contains, per category; `--head` adds a
trained head's own vocabulary. Results go to benchmarks/results/draft_vocab_coverage.json with a
plot. From the repository root:

    .venv/bin/python benchmarks/draft_vocab_coverage.py --head HEAD_FOLDER
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from head_training import machine_name
from safetensors.torch import load_file
from tqdm import tqdm

from drafting.training.data import training_conversations
from drafting.training.dev_set import CATEGORIES, read_dev_set
from drafting.training.trainer import frequent_tokens
from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
SIZES = (4096, 8192, 12288, 16384, 24576, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dev-set", type=Path, default=REPO_ROOT / "benchmarks/data/dev_set.jsonl")
    parser.add_argument("--conversations", type=int, default=2000, help="ShareGPT's first N")
    parser.add_argument("--head", type=Path, help="an EAGLE-3 head whose vocabulary to add")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/draft_vocab_coverage.json"
    )
    args = parser.parse_args()
    dev_set = read_dev_set(args.dev_set)
    answers = greedy_answers(dev_set)
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    answer_tokens = training_answer_tokens(tokenizer, args.conversations)
    vocab_size = len(tokenizer)
    vocabularies = {
        f"{n} most frequent": as_mask(frequent_tokens(answer_tokens, n, vocab_size), vocab_size)
        for n in SIZES
    }
    if args.head:
        vocabularies["the head's own"] = load_file(str(args.head / "model.safetensors"))["t2d"]
    coverage = {
        name: {"size": int(v.sum()), "share": covered_share(v, dev_set, answers)}
        for name, v in vocabularies.items()
    }
    for name, entry in coverage.items():
        print(name, json.dumps({k: round(v, 4) for k, v in entry["share"].items()}))
    results = {
        "machine": machine_name(),
        "conversations": args.conversations,
        "head": str(args.head) if args.head else None,
        "answer_tokens": sum(len(a) for a in answers),
        "coverage": coverage,
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(coverage, args.out.with_suffix(".png"))


def greedy_answers(dev_set: list[dict]) -> list[list[int]]:
    """The target's greedy answer (token ids, 128 at most) to each dev-set prompt."""
    llm = LLM(DEFAULT_MODEL, draft=None)
    prompts = [llm.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in dev_set]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128))
    return [list(o.outputs[0].token_ids) for o in outputs]


def training_answer_tokens(tokenizer, conversations: int) -> torch.Tensor:  # [tokens] long
    """The answer tokens of ShareGPT's first training conversations: what `train-head
    --draft-vocab-size` ranks."""
    tokenized = training_conversations("sharegpt", tokenizer, 0, conversations, max_tokens=1024)
    answers = [
        torch.tensor(c.token_ids)[torch.tensor(c.loss_mask)]
        for c in tqdm(tokenized, desc="answer tokens", total=conversations)
    ]
    return torch.cat(answers)


def as_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [vocab] bool
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[token_ids] = True
    return mask


def covered_share(
    vocabulary: torch.Tensor,  # [vocab] bool
    dev_set: list[dict],
    answers: list[list[int]],
) -> dict[str, float]:
    """{category or "all": share of the answers' tokens inside the vocabulary}."""
    inside: dict[str, list[int]] = {c: [0, 0] for c in (*CATEGORIES, "all")}
    for record, answer in zip(dev_set, answers):
        hits = int(vocabulary[torch.tensor(answer)].sum())
        for key in (record["category"], "all"):
            inside[key][0] += hits
            inside[key][1] += len(answer)
    return {k: hits / total for k, (hits, total) in inside.items()}


def plot(coverage: dict, path: Path) -> None:
    """Coverage against vocabulary size, one line per category; a trained head as a point."""
    chosen = [e for name, e in coverage.items() if name.endswith("most frequent")]
    with png_figure(path) as ax:
        for category in (*CATEGORIES, "all"):
            sizes, shares = [e["size"] for e in chosen], [e["share"][category] for e in chosen]
            ax.plot(sizes, shares, marker="o", label=category)
        for name, entry in coverage.items():
            if not name.endswith("most frequent"):
                ax.scatter([entry["size"]], [entry["share"]["all"]], marker="x", label=name)
        ax.set(xlabel="draft vocabulary size", ylabel="share of the target's greedy tokens")
        ax.legend()


if __name__ == "__main__":
    main()
