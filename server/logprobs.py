"""Engine logprobs in OpenAI's two shapes: chat (`content` entries) and legacy completions."""

from __future__ import annotations

from engine.outputs import TokenLogprob
from server.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprob


def chat_logprobs(tokenizer, entries: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        text = _token_text(tokenizer, entry.token_id)
        top = [
            TopLogprob(token=(t := _token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode()))
            for tid, lp in entry.top_logprobs
        ]
        content.append(
            TokenLogprobEntry(
                token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer, entries: list[TokenLogprob] | None, text_offset: int
) -> CompletionLogprobs | None:
    if entries is None:
        return None
    result = CompletionLogprobs()
    for entry in entries:
        text = _token_text(tokenizer, entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(
            {_token_text(tokenizer, tid): lp for tid, lp in entry.top_logprobs}
        )
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
