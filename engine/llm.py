"""LLM: the offline Python facade, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.errors import AerieError
from engine.execution.model_files import DEFAULT_MODEL
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.spec.draft_method import resolve_draft

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """`LLM(model, draft="auto", **engine_options)`; `generate()` and `chat()` return outputs in
    prompt order. `draft` is an EAGLE head folder, "auto" (the head Aerie ships for the model, if
    any) or None (plain decoding)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        draft: str | None = "auto",
        **engine_options: Any,
    ) -> None:
        config = EngineConfig.from_options(
            model, draft=resolve_draft(model, draft), **engine_options
        )
        self.engine = LLMEngine(config)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _params_per_prompt(sampling_params, len(prompts))
        # Validate every prompt before scheduling any, so bad input changes nothing.
        requests = [
            self.engine.make_request(str(next(self._request_ids)), p, sp)
            for p, sp in zip(prompts, params)
        ]
        for request in requests:
            self.engine.add_request(request.request_id, request)
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        template = self.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(template["input_ids"])

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id in results:
                        results[delta.request_id].merge(delta)
                    else:
                        results[delta.request_id] = delta
                    bar.update(int(delta.finished))
        return [results[r] for r in request_ids]


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise AerieError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
