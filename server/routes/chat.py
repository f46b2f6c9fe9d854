"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from fastapi import APIRouter, Request

from server.auth import require_api_key
from server.errors import APIError
from server.generation import (
    EngineCall,
    EngineStreamingResponse,
    chunk_writer,
    collect,
    sse_stream,
    start_call,
)
from server.logprobs import chat_logprobs
from server.prompts import chat_prompt_ids
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    random_id,
    unix_time,
)
from server.sampling import chat_sampling_params
from server.state import StateDep
from server.structured import checked_grammar, requested_grammar
from server.tool_answers import ToolAnswers
from server.tool_parsers import parser_for_template
from server.tools import tool_request

router = APIRouter(dependencies=[require_api_key])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, http_request: Request, state: StateDep
):
    engine = state.ready_engine()
    state.check_model(body.model)
    tokenizer = engine.engine.tokenizer
    tools = tool_request(body)
    answers = _tool_answers(tools, tokenizer)
    grammar = _grammar(body, tools, engine.engine.grammars)
    params = chat_sampling_params(body, grammar, _skip_special_tokens(answers))
    prompt = chat_prompt_ids(tokenizer, body, tools)
    state.check_queue(engine)
    request_id, model = random_id("chatcmpl"), state.settings.served_model_name
    call = start_call(engine, request_id, [prompt], params)
    if body.stream:
        chunk = chunk_writer(ChatCompletionChunk, request_id, model)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _choice_chunks(call, chunk, tokenizer, params.n, answers)
        return EngineStreamingResponse(sse_stream(call, chunks, chunk, include_usage), call)
    (final,) = await collect(call, http_request)
    choices = []
    for c in final.outputs:
        message, finish_reason = AssistantMessage(content=c.text), c.finish_reason
        if answers.active:
            message, finish_reason = answers.message(c.text, c.finish_reason)
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(tokenizer, c.logprobs),
                finish_reason=finish_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id, created=unix_time(), model=model, choices=choices, usage=call.usage
    )


def _tool_answers(tools, tokenizer) -> ToolAnswers:
    parser = parser_for_template(tokenizer.chat_template) if tools.mode == "auto" else None
    return ToolAnswers(tools, parser)


def _skip_special_tokens(answers: ToolAnswers) -> bool | None:
    """Mistral's and Llama 3's call markers are special tokens: keep them in the text."""
    if answers.parser is not None and answers.parser.family in ("mistral", "llama3_json"):
        return False
    return None


def _grammar(body: ChatCompletionRequest, tools, compiler):
    """The grammar of the answer: a forced tool call's, or the structured-output fields'."""
    asked = requested_grammar(body)
    forced = tools.grammar()
    if forced is not None and asked is not None:
        raise APIError(
            400,
            f"{asked[1]} cannot be combined with tool_choice '{tools.mode}' (the answer is "
            "then the tool call)",
            param=asked[1],
        )
    if asked is not None and tools.mode == "auto":
        raise APIError(
            400,
            f"{asked[1]} cannot be combined with tools under tool_choice 'auto' yet: use "
            "tool_choice 'none', 'required' or a named function",
            param=asked[1],
        )
    if forced is not None:
        return checked_grammar(compiler, forced, "tools")
    return None if asked is None else checked_grammar(compiler, *asked)


async def _choice_chunks(
    call: EngineCall, chunk: Callable[..., str], tokenizer, n: int, answers: ToolAnswers
) -> AsyncGenerator[str, None]:
    """The role delta of each choice first, then content deltas (tool calls at the end, whole),
    and a final chunk with finish_reason per choice."""
    for index in range(n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    streams = [answers.stream() for _ in range(n)] if answers.active else None
    async for _, delta in call.deltas():
        for c in delta.outputs:
            text, calls, finish_reason = c.text, None, c.finish_reason
            if streams is not None:
                text = streams[c.index].feed(c.text)
                if finish_reason is not None:
                    rest, calls, finish_reason = streams[c.index].finish(finish_reason)
                    text += rest
            if text or c.logprobs:
                delta_ = ChatDelta(content=text)
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=c.index,
                            delta=delta_,
                            logprobs=chat_logprobs(tokenizer, c.logprobs),
                        )
                    ]
                )
            if calls:
                yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(tool_calls=calls))])
            if finish_reason is not None:
                yield chunk(
                    [ChatChunkChoice(index=c.index, delta=ChatDelta(), finish_reason=finish_reason)]
                )
