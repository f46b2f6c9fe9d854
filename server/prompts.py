"""Turning chat messages and completion prompts into token ids, through transformers."""

from __future__ import annotations

import inspect

from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

_UNSUPPORTED_ROLES = ("tool", "function")


def chat_prompt_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    conversation = [_plain_message(m, i) for i, m in enumerate(body.messages)]
    template_kwargs = _template_kwargs(tokenizer, body)
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


def _plain_message(message: ChatMessage, index: int) -> dict[str, str]:
    if message.role in _UNSUPPORTED_ROLES:
        raise APIError(
            400,
            f"messages[{index}]: role '{message.role}' is not supported yet",
            param=f"messages.{index}.role",
        )
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": _text_content(message, index)}


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
