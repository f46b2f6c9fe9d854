"""Tool calls out of a model's text, one parser per chat-template family.

- `tagged`: Hermes / Qwen and SmolLM2: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (SmolLM2 writes a JSON list inside one pair of tags); a missing closing tag at the end is fine.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or
  `[TOOL_CALLS]name[ARGS]{...}`.
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`, several separated by `;`).
A call whose JSON does not parse, or names no tool of the request, stays text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolCallParser:
    family: str
    start_marker: str  # text that opens the tool-call part of an answer ("" : the answer's start)

    def extract(self, text: str, tool_names: set[str]) -> tuple[str | None, list[ParsedCall]]:
        """(the content left, the calls) of a finished answer; (text, []) when it calls nothing."""
        if self.family == "tagged":
            content, calls = _tagged(text)
        elif self.family == "mistral":
            content, calls = _mistral(text)
        else:
            content, calls = _llama3_json(text)
        calls = [c for c in calls if c is not None and c.name in tool_names]
        if not calls:
            return text, []
        return (content.strip() or None), calls

    def may_start_calls(self, text: str) -> int:
        """Where in `text` a tool-call part starts or may start (its length: nowhere), so a
        stream holds back what follows."""
        if not self.start_marker:
            stripped = text.lstrip()
            if not stripped or stripped[0] in "{<":
                return 0
            return len(text)
        found = text.find(self.start_marker)
        if found >= 0:
            return found
        for keep in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


PARSERS = {
    "tagged": ToolCallParser("tagged", "<tool_call>"),
    "mistral": ToolCallParser("mistral", "[TOOL_CALLS]"),
    "llama3_json": ToolCallParser("llama3_json", ""),
}


def parser_for_template(template: str | None) -> ToolCallParser:
    """The parser of the chat template's family (tagged for templates that know no tools:
    the server then describes the tools and that syntax in a system message)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return PARSERS["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return PARSERS["llama3_json"]
    return PARSERS["tagged"]


def _call(value, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls(value, arguments_key: str = "arguments") -> list[ParsedCall | None]:
    items = value if isinstance(value, list) else [value]
    return [_call(item, arguments_key) for item in items]


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _tagged(text: str) -> tuple[str, list[ParsedCall | None]]:
    calls: list[ParsedCall | None] = []
    for body in _TAGGED.findall(text):
        value = _loads(body.strip())
        calls += [None] if value is None else _calls(value)
    content = text[: text.find("<tool_call>")] if "<tool_call>" in text else text
    return content, calls


def _mistral(text: str) -> tuple[str, list[ParsedCall | None]]:
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return text, []
    content, rest = text.split(marker, 1)
    calls: list[ParsedCall | None] = []
    for part in rest.split(marker):
        part = part.strip()
        if "[ARGS]" in part:
            name, arguments = part.split("[ARGS]", 1)
            calls.append(_call({"name": name.strip(), "arguments": arguments.strip()}))
        else:
            value = _loads(part)
            calls += [None] if value is None else _calls(value)
    return content, calls


def _llama3_json(text: str) -> tuple[str, list[ParsedCall | None]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    values = [_loads(part) for part in body.split(";")]
    if any(v is None for v in values):
        values = [_loads(body)]
    return "", [_call(v, "parameters") for v in values if v is not None]
