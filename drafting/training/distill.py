"""`aerie distill-data`: the target's own answers to training conversations, as a JSONL of messages.

A head learns to predict what the target will say, so its training answers are the target's own
(self-distillation, as Medusa-2 and the EAGLE authors do), not ShareGPT's ChatGPT replies. Each
source conversation is replayed turn by turn: the target answers the first user turn, then each
later user turn after its own earlier answers, while the context fits `max_context_tokens`. A
`sampled_share` of the conversations (chosen by index, so reruns agree) is answered at
`sampled_temperature`, so heads also learn the text sampled requests produce; the rest greedily.

Conversations stream through the engine's continuous batching, one turn of each in flight at a time
(a finished turn's follow-up joins the batch at once and reuses its cached prefix). Each record is
written as soon as its conversation is complete, naming its source conversation, so a long one
never holds back the others and a rerun answers only the sources no record names. The held-out
slice (`HOLDOUT_EVERY`) is skipped, as are conversations whose first turn does not fit.

With `continue_from` (earlier records of this command, such as first turns), each of its records
is replayed from its last answer instead: the target answers the conversation's later user turns,
and only the records that gained a turn are written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from drafting.training.data import Message, is_held_out, load_conversations, open_text
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class DistillConfig:
    target: str
    data: str
    out: Path
    max_conversations: int = 2000  # records written
    max_context_tokens: int = 2048  # a turn is answered only if its prompt plus answer fit
    max_turns: int = 8  # user turns answered per conversation
    max_tokens: int = 256  # per answer
    sampled_share: float = 0.0  # of conversations answered by sampling
    sampled_temperature: float = 0.7
    max_num_seqs: int = 96  # turns generated at once
    seed: int = 0
    continue_from: Path | None = None  # earlier records whose later turns are answered

    def __post_init__(self) -> None:
        if not 0.0 <= self.sampled_share <= 1.0:
            raise ValueError(f"sampled_share must lie in [0, 1], got {self.sampled_share}")
        if self.max_tokens >= self.max_context_tokens:
            raise ValueError("max_tokens must be below max_context_tokens")


@dataclass
class _Replay:
    """One source conversation being answered by the target, one user turn at a time."""

    index: int
    source: list[Message]
    messages: list[Message] = field(default_factory=list)  # distilled so far
    next_turn: int = 0  # position in `source` of the next message to copy
    turns_answered: int = 0
    turns_before: int = 0  # answered by an earlier record this replay continues
    asked: Message | None = None  # the user turn being answered

    @classmethod
    def after(cls, index: int, source: list[Message], messages: list[Message]) -> _Replay:
        """The replay of `source` that continues an earlier record's `messages`."""
        turns = sum(m["role"] == "assistant" for m in messages)
        users = [i for i, m in enumerate(source) if m["role"] == "user"]
        next_turn = users[turns - 1] + 1 if turns else 0  # past the last user turn answered
        return cls(index, source, list(messages), next_turn, turns, turns)

    @property
    def gained_a_turn(self) -> bool:
        return self.turns_answered > self.turns_before

    def next_prompt(self) -> list[Message] | None:
        """The messages up to the next user turn, or None when the source has none left."""
        while self.next_turn < len(self.source):
            message = self.source[self.next_turn]
            self.next_turn += 1
            if message["role"] == "user":
                return [*self.messages, message]
            if message["role"] == "system" and not self.messages:
                self.messages.append(message)
        return None

    def record(self) -> str:
        return json.dumps({"messages": self.messages, "source": self.index}) + "\n"


def distill(config: DistillConfig) -> Path:
    """Append the target's answers to `config.out` until it holds `max_conversations` records."""
    out = Path(config.out)
    written = _written_sources(out)
    done = len(written)
    llm = LLM(config.target, draft=None, max_num_seqs=config.max_num_seqs)
    replays = _continued(config) if config.continue_from else _fresh(config)
    replays = (r for r in replays if r.index not in written)
    total = config.max_conversations
    bar = tqdm(total=total, initial=done, desc="distilling", unit="conversation")
    # conversations complete in bursts (every turn of one must finish): the tokens show progress
    tokens = tqdm(desc="answer tokens", unit="token", position=1, mininterval=30)
    with out.open("a") as file:
        for record in islice(_answers(llm, replays, config, tokens.update), max(total - done, 0)):
            file.write(record)
            file.flush()
            bar.update()
    tokens.close()
    bar.close()
    return out


def _answers(
    llm: LLM,
    replays: Iterable[_Replay],
    config: DistillConfig,
    count_tokens: Callable[[int], object] = lambda n: None,
):
    """JSONL records of the replayed conversations that gained a turn, each as soon as it is
    complete. Twice `max_num_seqs` conversations are kept in flight, so a finished one's slot is
    taken at once. `count_tokens` hears how many answer tokens each engine step generated."""
    engine = llm.engine
    replays = iter(replays)
    in_flight: dict[str, tuple[_Replay, RequestOutput | None]] = {}
    while True:
        while len(in_flight) < 2 * config.max_num_seqs:
            replay = next(replays, None)
            if replay is None:
                break
            if not _submit_next_turn(llm, replay, config, in_flight):
                continue  # its next turn does not fit
        if not engine.has_unfinished_requests():
            break
        deltas = engine.step()
        count_tokens(sum(len(delta.outputs[0].token_ids) for delta in deltas))
        for delta in deltas:
            replay, output = in_flight[delta.request_id]
            if output is None:
                in_flight[delta.request_id] = (replay, output := delta)
            else:
                output.merge(delta)
            if output.finished:
                del in_flight[delta.request_id]
                answer = {"role": "assistant", "content": output.outputs[0].text}
                replay.messages.extend([replay.asked, answer])
                replay.turns_answered += 1
                if not _submit_next_turn(llm, replay, config, in_flight) and replay.gained_a_turn:
                    yield replay.record()


def _submit_next_turn(llm: LLM, replay: _Replay, config: DistillConfig, in_flight: dict) -> bool:
    """Queue the replay's next user turn, if it has one that fits; False: it is complete."""
    if replay.turns_answered >= config.max_turns:
        return False
    prompt = replay.next_prompt()
    if prompt is None:
        return False
    ids = llm.apply_chat_template(prompt)
    if len(ids) + config.max_tokens > config.max_context_tokens:
        return False
    replay.asked = prompt[-1]
    request_id = f"{replay.index}:{replay.turns_answered}"
    llm.engine.add_request(request_id, ids, _params(config, replay.index, replay.turns_answered))
    in_flight[request_id] = (replay, None)
    return True


def _params(config: DistillConfig, index: int, turn: int) -> SamplingParams:
    sampled = _is_sampled(index, config.sampled_share)
    return SamplingParams(
        temperature=config.sampled_temperature if sampled else 0.0,
        max_tokens=config.max_tokens,
        seed=config.seed + 1000 * index + turn,
    )


def _is_sampled(index: int, share: float) -> bool:
    """Whether conversation `index` is answered by sampling: spread evenly, `share` of them."""
    return int((index + 1) * share) > int(index * share)


def _fresh(config: DistillConfig) -> Iterator[_Replay]:
    """A replay of each source conversation outside the held-out slice, from its start."""
    for index, messages in enumerate(load_conversations(config.data)):
        if not is_held_out(index):
            yield _Replay(index, messages)


def _continued(config: DistillConfig) -> Iterator[_Replay]:
    """A replay of each `continue_from` record, in its order, from the record's last answer."""
    sources = list(load_conversations(config.data))
    with open_text(config.continue_from) as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                yield _Replay.after(record["source"], sources[record["source"]], record["messages"])


def _written_sources(path: Path) -> set[int]:
    """The source conversations `path` holds records of; a line cut off by an interruption is
    removed."""
    if not path.exists():
        return set()
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    if complete != text:
        path.write_text(complete)
    return {json.loads(line)["source"] for line in complete.splitlines()}
