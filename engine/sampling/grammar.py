"""Grammar-constrained decoding: what a request's output must match (GrammarSpec), compiled once
per grammar (GrammarCompiler), and the per-sequence matcher that says which tokens may come next.

Backed by llguidance (docs/structured-outputs.md says why). A constrained distribution is the
target's with every token the grammar forbids masked to -inf. Invariants: a matcher only consumes
tokens its mask allowed (so it never enters llguidance's sticky error state); a sequence's matcher
stands after its output tokens between steps, and whoever walks it along a draft path rolls it
back before returning. Once the grammar is complete only the end-of-sequence token is allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch

from engine.errors import InvalidRequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# JSON as json.dumps writes it: one space after each separator and none elsewhere, so the
# model cannot pad the output with whitespace (a schema's "x-guidance" may say otherwise).
_JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `source`: the JSON schema's text (json_schema), the regex, the
    Lark grammar, or a JSON list of the allowed strings (choice); empty for json_object."""

    kind: GrammarKind
    source: str = ""

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's input form; raises InvalidRequestError on malformed input."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_LAYOUT
            )
        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.source, defaults=_JSON_LAYOUT
                )
            except ValueError as exc:
                raise InvalidRequestError(f"invalid JSON schema: {exc}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        choices = json.loads(self.source)
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(_regex_literal, choices)))


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class CompiledGrammar:
    """A validated grammar: new matchers for it are cheap copies of one fresh matcher."""

    def __init__(self, template, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._template = template
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarCompiler:
    """Compiles grammars for one tokenizer, keeping the most recent `cache_size` by spec.
    Thread-safe: requests are made on the server's threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None  # llguidance's view of the tokenizer, built on first use (~1 s)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiled = self._compile(spec)
            self._cache[spec] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        tokenizer = self._llguidance_tokenizer()
        grammar = spec.llguidance_grammar()
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise InvalidRequestError(f"invalid {_KIND_NAMES[spec.kind]}: {problem.strip()}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_KIND_NAMES[spec.kind]}: {matcher.get_error()}")
        return CompiledGrammar(matcher, self.vocab_size, frozenset(self._eos))

    def _llguidance_tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            eos = self._eos or None
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                )
            except ValueError:  # a tokenizer.json llguidance cannot read: give it the token table
                table = llguidance.TokenizerWrapper(_TokenTable(self._hf_tokenizer))
                self._tokenizer = llguidance.LLTokenizer(
                    table, n_vocab=self.vocab_size, eos_token=eos
                )
        return self._tokenizer


class _TokenTable:
    """A tokenizer as llguidance's generic interface sees it: each token's bytes, the special
    ids, and an encoder. Only for tokenizers whose tokens decode on their own (no merges across
    tokens), such as the character-level ones of the tests."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [
            b"" if i in special else tokenizer.decode([i]).encode() for i in range(len(tokenizer))
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


_KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "lark": "grammar",
}


class GrammarMatcher:
    """One sequence's position in its grammar. After the end of sequence only more of it may
    follow (requests with ignore_eos), which the matcher allows without consuming."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size, self.eos_token_ids)

    def advance(self, tokens: list[int]) -> int:
        """Consume `tokens` up to the first the grammar forbids; return how many it consumed
        (what `rollback` takes back)."""
        num_valid = self._matcher.validate_tokens(tokens) if tokens else 0
        if num_valid:
            self._matcher.consume_tokens(tokens[:num_valid])
        return num_valid

    def allows(self, path: list[int], num_consumed: int) -> bool:
        """Whether `path`, of which `advance` just consumed `num_consumed`, is allowed: all of
        it, or the grammar stopped and the rest repeats the end of sequence."""
        rest = path[num_consumed:]
        return not rest or (
            self._matcher.is_stopped() and all(t in self.eos_token_ids for t in rest)
        )

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into `out`, an int32 [words] row (bit i of word w: token
        32 w + i)."""
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def bitmasks_along(self, paths: list[list[int]]) -> torch.Tensor:
        """The allowed next tokens after each path of tokens from here: [len(paths), words]
        int32. A path the grammar forbids allows nothing. Leaves the matcher where it was."""
        return self.drafts_along(paths, forced=False)[0]

    def drafts_along(
        self, paths: list[list[int]], forced: bool = True
    ) -> tuple[torch.Tensor, list[int]]:
        """`bitmasks_along(paths)`, and (with `forced`) after each path the next token of what
        the grammar forces (literal keys, punctuation, in the tokenizer's own tokenization), -1
        where it forces nothing or forbids the path; one walk along each path."""
        masks = torch.zeros(len(paths), num_bitmask_words(self.vocab_size), dtype=torch.int32)
        tokens = [-1] * len(paths)
        for row, path in enumerate(paths):
            consumed = self.advance(path)
            if self.allows(path, consumed):
                self.fill_bitmask(masks[row])
            if forced and consumed == len(path):
                tokens[row] = next(iter(self._matcher.compute_ff_tokens()), -1)
            self.rollback(consumed)
        return masks, tokens


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def all_allowed(num_rows: int, vocab_size: int) -> torch.Tensor:
    """Bitmask rows [num_rows, words] that forbid nothing."""
    return torch.full((num_rows, num_bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 -> [N, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [N, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens to -inf, in place. logits: [N, vocab]; bitmask: [N, words] int32."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
    return logits.masked_fill_(~allowed, float("-inf"))
