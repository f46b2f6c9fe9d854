"""Incremental detokenization over a byte-level tokenizer, where one character may take several
tokens: the text comes out whole, and a sequence cut inside a character still ends with all of
its text."""

from __future__ import annotations

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.core.request import Request, Sequence, SequenceStatus
from engine.core.stop_checker import append_token
from engine.outputs import RequestMetrics
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.sampling_params import SamplingParams

# 4 bytes in UTF-8, so 4 tokens below; "é" is 2.
TEXT = "caf\u00e9 \U0001f600 ok"


@pytest.fixture(scope="module")
def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per byte, as GPT-2-style byte-level BPE has before its merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], start: int) -> list[str]:
    return [
        detokenizer.decode_next(token_ids[:end]) for end in range(start + 1, len(token_ids) + 1)
    ]


def test_multi_byte_characters_come_out_whole(byte_tokenizer) -> None:
    prompt = byte_tokenizer.encode("say: ")
    output = byte_tokenizer.encode(TEXT)
    assert len(output) == len(TEXT.encode())  # one token per byte
    detokenizer = IncrementalDetokenizer.for_prompt(byte_tokenizer, len(prompt))
    pieces = stream(detokenizer, prompt + output, len(prompt))
    assert "".join(pieces) == TEXT
    assert "\U0001f600" in pieces  # the emoji's last byte brings the whole character
    assert "\ufffd" not in "".join(pieces)


def test_flush_returns_the_text_of_a_character_cut_short(byte_tokenizer) -> None:
    prompt = byte_tokenizer.encode("say: ")
    output = byte_tokenizer.encode(TEXT)[: len("caf\u00e9 ".encode()) + 2]  # half the emoji
    detokenizer = IncrementalDetokenizer.for_prompt(byte_tokenizer, len(prompt))
    streamed = "".join(stream(detokenizer, prompt + output, len(prompt)))
    assert streamed == "caf\u00e9 "  # the half character is held back ...
    rest = detokenizer.flush(prompt + output)
    assert rest and set(rest) == {"\ufffd"}  # ... until the sequence ends there
    assert streamed + rest == byte_tokenizer.decode(output)


@pytest.mark.parametrize("max_tokens", [6, 7, 8, 9])  # "café " is 6 tokens, the emoji 4 more
def test_text_of_a_sequence_that_ends_on_its_length_is_its_tokens_decoded(
    byte_tokenizer, max_tokens
) -> None:
    prompt = byte_tokenizer.encode("say: ")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(
        "r", None, prompt, params, len(prompt) + max_tokens, frozenset(), RequestMetrics(0.0)
    )
    detokenizer = IncrementalDetokenizer.for_prompt(byte_tokenizer, len(prompt))
    seq = Sequence(0, request, 0, list(prompt), len(prompt), detokenizer)
    statuses = [
        append_token(seq, token, None) for token in byte_tokenizer.encode(TEXT)[:max_tokens]
    ]
    assert statuses == [None] * (max_tokens - 1) + [SequenceStatus.FINISHED_LENGTH]
    assert seq.text == byte_tokenizer.decode(seq.token_ids[len(prompt) :])
