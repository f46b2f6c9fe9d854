"""A chat request's `tools` and `tool_choice`: validated, rendered for the chat template, and, for
`required` or a named function, turned into the grammar the answer is generated under.

- `none`: the tools stay out of the prompt; the answer is text.
- `auto`: the template receives the tools; the model's own tool-call syntax is parsed afterwards
  (server/tool_parsers.py).
- `required`: the answer is a JSON list of calls `[{"name": ..., "arguments": {...}}]`, each
  naming a function and with arguments valid under its parameter schema (one call when
  parallel_tool_calls is false).
- a named function: the answer is that function's arguments object.
A template that knows no tools (SmolLM2's) gets them in a system message that asks for the
`<tool_call>[...]</tool_call>` syntax the tagged parser reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling.grammar import GrammarSpec
from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.tool_parsers import ParsedCall

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    mode: str  # none, auto, required, named
    named: str | None  # the function tool_choice names
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    @property
    def in_prompt(self) -> bool:
        return bool(self.functions) and self.mode != "none"

    def grammar(self) -> GrammarSpec | None:
        """The grammar of a forced answer (`required` or named), None otherwise."""
        if self.mode == "named":
            (function,) = [f for f in self.functions if f.name == self.named]
            return GrammarSpec("json_schema", json.dumps(function.parameters, sort_keys=True))
        if self.mode != "required":
            return None
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in self.functions
            ]
        }
        schema = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))

    def forced_calls(self, text: str) -> list[ParsedCall]:
        """The calls of an answer generated under `grammar()` (empty if cut short)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.mode == "named":
            return [ParsedCall(self.named, json.dumps(value, ensure_ascii=False))]
        return [
            ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value
        ]


def tool_request(body: ChatCompletionRequest) -> ToolRequest:
    if body.functions:
        raise APIError(
            400, "functions is deprecated and not supported: use tools", param="functions"
        )
    functions = tuple(_function(tool, i) for i, tool in enumerate(body.tools or []))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    mode, named = _choice(body.tool_choice, set(names))
    parallel = body.parallel_tool_calls is not False
    return ToolRequest(functions, mode, named, parallel)


def _function(tool: Any, index: int) -> Function:
    param = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{param}: only tools of type 'function' are supported", param=param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            400,
            f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
            param=f"{param}.function.name",
        )
    parameters = function.get("parameters") or _ANY_OBJECT
    if not isinstance(parameters, dict):
        raise APIError(
            400,
            f"{param}.function.parameters must be a JSON schema object",
            param=f"{param}.function.parameters",
        )
    return Function(name, function.get("description"), parameters)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise APIError(
                400, f"tool_choice '{choice}' needs at least one tool", param="tool_choice"
            )
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = function["name"]
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise APIError(
            400,
            f"tool_choice names the function '{name}', which is not among the tools "
            f"(tools: {known})",
            param="tool_choice",
        )
    return "named", name


def tools_system_prompt(functions: tuple[Function, ...]) -> str:
    """Describes the tools and the call syntax, for templates that do not render tools."""
    listing = json.dumps([f.as_openai()["function"] for f in functions], ensure_ascii=False)
    return (
        "You can call functions to answer. The functions available:\n"
        f"<tools>{listing}</tools>\n\n"
        "To call functions, answer only with the calls, in this form:\n"
        '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>\n'
        "If no function fits, answer in plain text."
    )
