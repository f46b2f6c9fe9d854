"""Incremental detokenization: the text each new token adds, without re-decoding everything."""

from __future__ import annotations

from dataclasses import dataclass

# Earlier tokens decoded with each new one, so it gets its leading space and multi-byte characters
# split across tokens come out whole.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    """Decodes a growing token list (prompt then output). A token that ends inside a UTF-8
    character adds no text until a later token completes it."""

    tokenizer: object
    skip_special_tokens: bool
    prefix_offset: int
    read_offset: int

    @classmethod
    def for_prompt(cls, tokenizer, prompt_len: int, skip_special_tokens: bool = True):
        return cls(tokenizer, skip_special_tokens, max(prompt_len - _CONTEXT_TOKENS, 0), prompt_len)

    def decode_next(self, token_ids: list[int]) -> str:
        """The text added by the tokens of `token_ids` past the last call."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]

    def flush(self, token_ids: list[int]) -> str:
        """The text still held back at the end of `token_ids` (the tokens of a character cut
        short, which decode to U+FFFD), for a sequence that ends there."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(token_ids)
        return full[len(prefix) :]

    def copy(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, self.skip_special_tokens, self.prefix_offset, self.read_offset
        )

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
