"""`aerie distill-data`: the target's own answers to training prompts, as a JSONL of messages.

A head learns to predict what the target will say. ShareGPT's replies were written by ChatGPT, not
by the target, so a head trained on them learns someone else's habits; regenerating the replies
with the target itself (self-distillation, as Medusa-2 does and as the EAGLE authors regenerated
ShareGPT) trains the head on the text it will meet when serving. The output feeds
`aerie train-head --data FILE.jsonl`.

Prompts are the first user turns of the source conversations, skipping the held-out slice that
`train-head` evaluates on. Writing is resumable: a rerun continues after the last complete record.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from drafting.data import HOLDOUT_EVERY, load_conversations
from engine.llm import LLM
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class DistillConfig:
    target: str
    data: str
    out: Path
    max_prompts: int = 2000
    max_prompt_tokens: int = 384  # longer prompts are skipped
    max_tokens: int = 256  # per answer
    temperature: float = 0.0
    chunk: int = 64  # prompts generated together, then appended to the file
    seed: int = 0


def distill(config: DistillConfig) -> Path:
    """Append the target's answers to `config.out` until it holds `max_prompts` records."""
    out = Path(config.out)
    done = _complete_records(out)
    llm = LLM(config.target, draft=None, max_num_seqs=config.chunk)
    prompts = islice(_first_turns(llm, config), done, config.max_prompts)
    bar = tqdm(total=config.max_prompts, initial=done, desc="distilling answers", unit="answer")
    with out.open("a") as file:
        while chunk := list(islice(prompts, config.chunk)):
            file.write("".join(_records(llm, chunk, config, done + bar.n)))
            file.flush()
            bar.update(len(chunk))
    bar.close()
    return out


def _first_turns(llm: LLM, config: DistillConfig) -> Iterator[tuple[list[dict], list[int]]]:
    """(messages, prompt ids) of each usable first user turn, outside the held-out slice."""
    for index, messages in enumerate(load_conversations(config.data)):
        if index % HOLDOUT_EVERY == 0:
            continue
        turn = messages[:2] if messages[0]["role"] == "system" else messages[:1]
        if turn[-1]["role"] != "user":
            continue
        ids = llm.apply_chat_template(turn)
        if len(ids) <= config.max_prompt_tokens:
            yield turn, ids


def _records(llm: LLM, chunk: list, config: DistillConfig, first_index: int) -> list[str]:
    params = [
        SamplingParams(
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            seed=config.seed + first_index + i,
        )
        for i in range(len(chunk))
    ]
    outputs = llm.generate([ids for _, ids in chunk], params, use_tqdm=False)
    return [
        json.dumps({"messages": [*turn, {"role": "assistant", "content": out.outputs[0].text}]})
        + "\n"
        for (turn, _), out in zip(chunk, outputs)
    ]


def _complete_records(path: Path) -> int:
    """How many whole lines `path` holds; a line cut off by an interruption is removed."""
    if not path.exists():
        return 0
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    if complete != text:
        path.write_text(complete)
    return complete.count("\n")
