"""`aerie distill-data`: the target's own answers to training prompts, as a JSONL of messages.

A head learns to predict what the target will say. ShareGPT's replies were written by ChatGPT, not
by the target, so a head trained on them learns someone else's habits; regenerating the replies
with the target itself (self-distillation, as Medusa-2 does and as the EAGLE authors regenerated
ShareGPT) trains the head on the text it will meet when serving. The output feeds
`aerie train-head --data FILE.jsonl`.

Prompts are the first user turns of the source conversations, skipping the held-out slice that
`train-head` evaluates on. They stream through the engine's continuous batching (a finished answer's
slot goes to the next prompt at once, so the batch never drains to a long answer's tail), and each
answer is written, in prompt order, as soon as those before it are. Writing is resumable: a rerun
continues after the last complete record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from drafting.data import HOLDOUT_EVERY, load_conversations
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
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
    max_num_seqs: int = 96  # answers generated at once
    seed: int = 0


def distill(config: DistillConfig) -> Path:
    """Append the target's answers to `config.out` until it holds `max_prompts` records."""
    out = Path(config.out)
    done = _complete_records(out)
    llm = LLM(config.target, draft=None, max_num_seqs=config.max_num_seqs)
    prompts = islice(_first_turns(llm, config), done, config.max_prompts)
    bar = tqdm(total=config.max_prompts, initial=done, desc="distilling answers", unit="answer")
    with out.open("a") as file:
        for record in _answers(llm.engine, prompts, config, first_index=done):
            file.write(record)
            file.flush()
            bar.update()
    bar.close()
    return out


def _answers(
    engine: LLMEngine, prompts: Iterable, config: DistillConfig, first_index: int
) -> Iterator[str]:
    """JSONL records of the prompts' answers, in prompt order. Twice `max_num_seqs` requests are
    kept in the engine, so a finished one's slot is taken by the next prompt at once."""
    prompts = enumerate(prompts, start=first_index)
    turns: dict[int, list[dict]] = {}  # prompt index -> its messages, until written
    outputs: dict[int, RequestOutput] = {}  # finished answers not yet written
    next_index = first_index
    exhausted = False
    while True:
        while not exhausted and len(engine.requests) < 2 * config.max_num_seqs:
            item = next(prompts, None)
            if item is None:
                exhausted = True
                break
            index, (turn, ids) = item
            turns[index] = turn
            engine.add_request(str(index), ids, _params(config, index))
        if not engine.has_unfinished_requests():
            return
        for delta in engine.step():
            index = int(delta.request_id)
            if index in outputs:
                outputs[index].merge(delta)
            else:
                outputs[index] = delta
        while next_index in outputs and outputs[next_index].finished:
            answer = outputs.pop(next_index).outputs[0].text
            messages = [*turns.pop(next_index), {"role": "assistant", "content": answer}]
            yield json.dumps({"messages": messages}) + "\n"
            next_index += 1


def _params(config: DistillConfig, index: int) -> SamplingParams:
    return SamplingParams(
        temperature=config.temperature, max_tokens=config.max_tokens, seed=config.seed + index
    )


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


def _complete_records(path: Path) -> int:
    """How many whole lines `path` holds; a line cut off by an interruption is removed."""
    if not path.exists():
        return 0
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    if complete != text:
        path.write_text(complete)
    return complete.count("\n")
