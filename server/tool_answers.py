"""Turning a generated answer into an assistant message with tool calls, whole or streamed.

A forced answer (`required` or a named function) is all calls; an `auto` answer is parsed by its
template family's parser. Streaming sends content as it comes, holding back from where a
tool-call part starts (or may start); at the end each call is sent whole, in one chunk at its
index, so streamed deltas reassemble into exactly the calls of the unstreamed answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.protocol import AssistantMessage, FunctionCall, ToolCall, ToolCallDelta, random_id
from server.tool_parsers import ParsedCall, ToolCallParser
from server.tools import ToolRequest


@dataclass(frozen=True)
class ToolAnswers:
    tools: ToolRequest
    parser: ToolCallParser | None  # for `auto`

    @property
    def active(self) -> bool:
        return self.tools.mode in ("required", "named") or (
            self.tools.mode == "auto" and self.parser is not None
        )

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished answer."""
        if self.tools.mode in ("required", "named"):
            calls = self.tools.forced_calls(text)
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.extract(text, self.tools.names)
        if not self.tools.parallel:
            calls = calls[:1]
        return content, calls

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        content, calls = self.split(text)
        if not calls:
            return AssistantMessage(content=text), finish_reason
        return AssistantMessage(content=content, tool_calls=_tool_calls(calls)), "tool_calls"

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


def _tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=random_id("call"), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


@dataclass
class AnswerStream:
    """One choice's streamed answer."""

    answers: ToolAnswers
    text: str = ""
    num_sent: int = 0  # characters of `text` sent as content
    _forced: bool = field(init=False)

    def __post_init__(self) -> None:
        self._forced = self.answers.tools.mode in ("required", "named")

    def feed(self, delta: str) -> str:
        """Content that may be sent now."""
        self.text += delta
        if self._forced:
            return ""
        end = self.answers.parser.may_start_calls(self.text)
        sendable = self.text[self.num_sent : end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return sendable

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCallDelta], str | None]:
        """(the content left to send, the calls, the finish reason) at the end."""
        content, calls = self.answers.split(self.text)
        if not calls:
            return self.text[self.num_sent :], [], finish_reason
        rest = (content or "")[self.num_sent :] if content and len(content) > self.num_sent else ""
        deltas = [
            ToolCallDelta(index=i, id=call.id, function=call.function)
            for i, call in enumerate(_tool_calls(calls))
        ]
        return rest, deltas, "tool_calls"
