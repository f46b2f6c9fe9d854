"""Appending a sampled token to a sequence and deciding whether the sequence is done.

Tokens are appended one at a time, so a run of several accepted tokens ends exactly where plain
decoding would have ended. Text is decoded as tokens arrive; stop strings are searched only in the
newly added text (plus the overlap a stop string could straddle).
"""

from __future__ import annotations

from engine.core.request import Sequence, SequenceStatus
from engine.outputs import TokenLogprob


def append_token(
    seq: Sequence, token_id: int, logprob: TokenLogprob | None
) -> SequenceStatus | None:
    """Append `token_id` and its text to `seq`; return the finished status if it ends here."""
    request, params = seq.request, seq.request.params
    seq.token_ids.append(token_id)
    if logprob is not None:
        seq.logprobs.append(logprob)
    new_text = seq.detokenizer.decode_next(seq.token_ids)
    may_stop = seq.num_output_tokens >= params.min_tokens
    if may_stop and _is_stop_token(token_id, seq):
        seq.stop_reason = None if token_id in request.eos_token_ids else token_id
        if params.include_stop_str_in_output:
            seq.text += new_text
        return SequenceStatus.FINISHED_STOPPED
    previous_len = len(seq.text)
    seq.text += new_text
    if may_stop and params.stop and _truncate_at_stop_string(seq, previous_len):
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_tokens >= request.max_total_tokens:
        seq.text += seq.detokenizer.flush(seq.token_ids)
        return SequenceStatus.FINISHED_LENGTH
    return None


def _is_stop_token(token_id: int, seq: Sequence) -> bool:
    params = seq.request.params
    if token_id in params.stop_token_ids:
        return True
    return not params.ignore_eos and token_id in seq.request.eos_token_ids


def _truncate_at_stop_string(seq: Sequence, previous_len: int) -> bool:
    params = seq.request.params
    longest = max(len(s) for s in params.stop)
    search_from = max(0, previous_len - longest + 1)
    found = [(seq.text.find(s, search_from), s) for s in params.stop]
    found = [(i, s) for i, s in found if i >= 0]
    if not found:
        return False
    index, stop = min(found)
    seq.text = (
        seq.text[: index + len(stop)] if params.include_stop_str_in_output else seq.text[:index]
    )
    seq.stop_reason = stop
    return True


def held_back_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
