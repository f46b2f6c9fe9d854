"""Turning chat messages and completion prompts into token ids, through transformers."""

from __future__ import annotations

import inspect
import json

from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from server.tools import ToolRequest, tools_system_prompt

_UNSUPPORTED_ROLES = ("function",)


def chat_prompt_ids(tokenizer, body: ChatCompletionRequest, tools: ToolRequest) -> list[int]:
    """The prompt's token ids. A template that renders tools receives them (and earlier calls
    as `tool_calls` with dict arguments); one that does not gets them in a system message, and
    earlier calls written in the syntax that message asks for."""
    renders_tools = template_renders_tools(tokenizer)
    conversation = [_message(m, i, renders_tools) for i, m in enumerate(body.messages)]
    template_kwargs = _template_kwargs(tokenizer, body)
    if tools.in_prompt and renders_tools:
        template_kwargs["tools"] = [f.as_openai() for f in tools.functions]
    elif tools.in_prompt:
        conversation = _with_tools_described(conversation, tools)
    try:
        encoded = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=True,
            return_dict=True,
            **template_kwargs,
        )
    except Exception as exc:  # the template itself rejects the conversation (e.g. role order)
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    return list(encoded["input_ids"])


def _template_kwargs(tokenizer, body: ChatCompletionRequest) -> dict:
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message needs add_generation_prompt to be false",
            param="continue_final_message",
        )
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise APIError(
            400,
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )
    template_kwargs = dict(body.chat_template_kwargs or {})
    # apply_chat_template's own arguments are the request's to set (through its own fields), not
    # template variables.
    own_arguments = inspect.signature(tokenizer.apply_chat_template).parameters
    reserved = sorted(own_arguments.keys() & template_kwargs.keys())
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    return template_kwargs


def template_renders_tools(tokenizer) -> bool:
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else json.dumps(template or "")
    return "tools" in text


def _with_tools_described(conversation: list[dict], tools: ToolRequest) -> list[dict]:
    description = tools_system_prompt(tools.functions)
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{**first, "content": f"{first['content']}\n\n{description}"}, *conversation[1:]]
    return [{"role": "system", "content": description}, *conversation]


def _message(message: ChatMessage, index: int, renders_tools: bool) -> dict:
    if message.role in _UNSUPPORTED_ROLES:
        raise APIError(
            400,
            f"messages[{index}]: role '{message.role}' is not supported (use 'tool')",
            param=f"messages.{index}.role",
        )
    role = "system" if message.role == "developer" else message.role
    rendered = {"role": role, "content": _text_content(message, index)}
    if role == "tool":
        if not message.tool_call_id:
            raise APIError(
                400,
                f"messages[{index}]: a tool message needs the tool_call_id it answers",
                param=f"messages.{index}.tool_call_id",
            )
        rendered["tool_call_id"] = message.tool_call_id
    if role == "assistant" and message.tool_calls:
        calls = _earlier_calls(message.tool_calls, index)
        if renders_tools:
            rendered["tool_calls"] = calls
        else:
            listing = [c["function"] for c in calls]
            text = f"<tool_call>{json.dumps(listing, ensure_ascii=False)}</tool_call>"
            rendered["content"] = (rendered["content"] + "\n" + text).lstrip("\n")
    return rendered


def _earlier_calls(tool_calls: list[dict], index: int) -> list[dict]:
    """An assistant message's calls with their arguments parsed, as chat templates take them."""
    param = f"messages.{index}.tool_calls"
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{param}: each call needs function.name", param=param)
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise APIError(
                400, f"{param}: function.arguments must be JSON text", param=param
            ) from None
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _text_content(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"messages[{index}]: content parts of type '{part.type}' are not "
                "supported yet (only text)",
                param=f"messages.{index}.content",
            )
        texts.append(part.text)
    return "".join(texts)


def completion_prompts(tokenizer, body: CompletionRequest) -> list[list[int]]:
    """The prompt field as a list of token-id prompts (a string, strings, ids, or lists of ids)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
