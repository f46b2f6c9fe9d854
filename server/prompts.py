"""Turning chat messages and completion prompts into token ids, through transformers."""

from __future__ import annotations

from server.errors import APIError
from server.protocol import ChatMessage, CompletionRequest

_UNSUPPORTED_ROLES = ("tool", "function")


def chat_prompt_ids(
    tokenizer, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    conversation = [_plain_message(m, i) for i, m in enumerate(messages)]
    try:
        encoded = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
        )
    except Exception as exc:  # the template itself rejects the conversation (e.g. role order)
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    return list(encoded["input_ids"])


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
