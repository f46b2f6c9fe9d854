"""LLMEngine: requests in, token deltas out, one `step()` at a time.

Each step reads as the speculative-decoding algorithm: schedule; propose (the drafter grows a draft
tree per decoding sequence); verify (one target pass over every scheduled token and tree node);
accept (the drafter's lossless rule picks each sequence's new tokens); commit (move accepted K/V
into place, append tokens, check stops, free what finished and the step's draft scratch).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.draft_tree import DraftTree
from engine.core.request import Request, Sequence, SequenceStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.stop_checker import append_token, held_back_length
from engine.errors import InvalidRequestError
from engine.execution.layers.cpu_kernels import use_cpu_kernels
from engine.execution.layers.cpu_linear import use_cpu_linears
from engine.execution.layers.fp16_linear import use_fp16_linears
from engine.execution.model_files import (
    load_config,
    load_state_dict,
    load_tokenizer,
    resolve_model_path,
)
from engine.execution.model_runner import ForwardOutput, ModelRunner
from engine.execution.models.spec import ModelSpec
from engine.execution.verify_cost import measure_verify_cost
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request_validation import validate_request
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.sampling_params import SamplingParams
from engine.spec.draft_budget import DraftBudget, expected_tokens
from engine.spec.draft_controller import DraftController
from engine.spec.draft_method import DraftHead, load_draft_method
from engine.spec.draft_policy import DraftPolicy, StepReport
from engine.spec.drafter import Accepted, AutoregressiveDrafter, Drafter
from engine.stats import FinishedRequestStats, StepStats

logger = logging.getLogger(__name__)


@dataclass
class _Verdict:
    """One sampling sequence of a step: its draft tree, rows, and what it accepted."""

    seq: Sequence
    tree: DraftTree | None
    logits_row: int  # of the verify pass's logits: its last token's, or its tree root's
    token_rows: range
    accepted: Accepted | None = None
    num_emitted: int = 0  # accepted tokens actually appended (a stop cuts the rest)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        self.hf_config = hf_config = load_config(path)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.tokenizer = load_tokenizer(path)
        self.max_model_len = _max_model_len(config, self.spec)
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        state_dict = load_state_dict(path)
        self.draft_method = load_draft_method() if config.draft else None
        head = self._load_head(config) if config.draft else None
        extra_layers = head.kv_layer_shapes if head else ()
        self.runner = ModelRunner(
            config,
            self.spec,
            hf_config,
            state_dict,
            self.max_model_len,
            extra_layers,
            head.feature_layers if head else (),
        )
        if head:  # the head's passes are as few rows as the target's, and choose as they do
            head.split_kv_projection()
            if config.fp16_draft_weights:  # or half the bytes, where FBGEMM runs them
                use_fp16_linears(head)
            use_cpu_linears(head, self.runner.linear_kernels)
            use_cpu_kernels(head, self.runner.cpu_kernels)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = self._draft_policy() if head and config.adaptive_draft_budget else None
        self.drafter: Drafter = self._make_drafter(head) if head else AutoregressiveDrafter()
        self.scheduler = Scheduler(config, self.block_manager, self.drafter.num_lookahead_tokens)
        self.requests: dict[str, Request] = {}
        self.last_schedule = SchedulerOutput()  # the latest step's; read when a step fails
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._seq_ids = itertools.count()
        self._finished_stats: list[FinishedRequestStats] = []
        self._ttfts: list[float] = []  # this step's samples for StepStats (seconds)
        self._itls: list[float] = []

    def _load_head(self, config: EngineConfig) -> DraftHead:
        return self.draft_method.load_head(
            config.draft, self.spec, self.max_model_len, config.torch_device, config.torch_dtype
        )

    def _make_drafter(self, head: DraftHead) -> Drafter:
        # the extra layers allocated for the head, after the target's
        kv_layers = self.runner.kv_cache.layers[self.spec.num_layers :]
        return self.draft_method.make_drafter(
            head, self.runner.model, kv_layers, self.config, self.policy
        )

    def _draft_policy(self) -> DraftPolicy:
        """Time verify passes up to the largest a decode step builds (at most 256 tokens; the
        cost model extends its last slope beyond): the budget's first view of pass costs, which
        live passes then correct."""
        config = self.config
        largest = min(
            config.max_num_batched_tokens, config.max_num_seqs * config.draft_total_tokens, 256
        )
        cost = measure_verify_cost(self.runner, largest, config.draft_total_tokens)
        logger.info(
            "verify cost for the draft budget: %s; lm_head: %s",
            ", ".join(f"{n} tok {1000 * s:.1f} ms" for n, s in zip(cost.num_tokens, cost.seconds)),
            ", ".join(
                f"{n} rows {1000 * s:.1f} ms" for n, s in zip(cost.logits_rows, cost.logits_seconds)
            ),
        )
        self.runner.verify_cost = cost
        return DraftPolicy(DraftBudget(cost), DraftController(config.draft_controller_half_life))

    # ----------------------------------------------------------------- requests in
    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenize and validate a request without touching engine state (safe from any thread)."""
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, list(prompt)
        max_total = validate_request(
            prompt_ids,
            params,
            self.spec.vocab_size,
            self.max_model_len,
            self.config,
            self.block_manager.num_blocks,
        )
        metrics = RequestMetrics(
            arrival_time or time.monotonic(), num_prompt_tokens=len(prompt_ids)
        )
        grammar = self.grammars.compile(params.structured) if params.structured else None
        return Request(
            request_id, text, prompt_ids, params, max_total, self.eos_token_ids, metrics, grammar
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Request,
        params: SamplingParams | None = None,
    ) -> None:
        request = (
            prompt
            if isinstance(prompt, Request)
            else self.make_request(request_id, prompt, params or SamplingParams())
        )
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        seq = self._new_sequence(request, index=0)
        request.sequences.append(seq)
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; return its final delta (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        request.metrics.finished_time = time.monotonic()
        for index in range(len(request.sequences), request.params.n):  # choices never forked
            request.sequences.append(self._unforked_abort(request, index))
        self._finished_stats.append(_finished_stats(request))
        # the gauges move without a step
        self._emit_stats(SchedulerOutput(), [], num_prompt_tokens=0)
        return self._delta(request, request.sequences)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        batch = self.last_schedule = self.scheduler.schedule(self._planned_drafts())
        if not batch.scheduled:
            return []
        self._mark_scheduled(batch, time.monotonic())
        start = time.perf_counter()
        trees = self.drafter.propose(batch)  # propose
        proposed = time.perf_counter()
        verified = self.runner.execute(batch, trees)  # verify
        executed = time.perf_counter()
        num_prompt_tokens = self._record_verified(batch, trees, verified)
        checked = time.perf_counter()
        accepted = self._accept(batch, trees, verified)  # accept
        decided = time.perf_counter()
        outputs, settle_seconds = self._commit(batch, trees, accepted, verified)  # commit
        budget, num_decoding = None, 0  # counted by a speculative engine only
        if self.policy is not None:
            num_draft_tokens = sum(tree.num_draft_tokens for tree in trees.values())
            num_decoding = sum(1 for item in batch.scheduled if item.decoding)
            self._inform_policy(
                batch, num_draft_tokens, num_decoding, accepted, executed - proposed, start
            )
            budget = num_draft_tokens if num_decoding else None
        propose = proposed - start + settle_seconds
        verify, accept = checked - proposed, decided - checked
        self._emit_stats(
            batch,
            accepted,
            num_prompt_tokens=num_prompt_tokens,
            draft_budget=budget,
            num_decoding=num_decoding,
            propose_time_s=propose,
            verify_time_s=verify,
            accept_time_s=accept,
            other_time_s=time.perf_counter() - began - propose - verify - accept,
        )
        return outputs

    def _planned_drafts(self) -> set[int] | None:
        """The sequences the policy lets draft this step (None: every decoding one)."""
        if self.policy is None:
            return None
        scheduler = self.scheduler
        return self.policy.plan(scheduler.decoding_sequences(), scheduler.prompts_pending())

    def _inform_policy(
        self,
        batch: SchedulerOutput,
        num_draft_tokens: int,
        num_decoding: int,
        verdicts: list[_Verdict],
        pass_seconds: float,
        started: float,
    ) -> None:
        self.policy.observe_step(
            StepReport(
                seconds=time.perf_counter() - started,
                pass_seconds=pass_seconds,
                num_pass_tokens=batch.num_new_tokens + num_draft_tokens,
                num_decoding=num_decoding,
                prefilled=batch.num_new_tokens > num_decoding,
                num_tokens=sum(len(v.accepted.token_ids) for v in verdicts),
                trees=[
                    (v.seq, expected_tokens(v.tree.values[1:]), len(v.accepted.accepted_nodes))
                    for v in verdicts
                    if v.tree is not None
                ],
            )
        )

    def _record_verified(
        self, batch: SchedulerOutput, trees: dict[int, DraftTree], verified: ForwardOutput
    ) -> int:
        """The pass wrote the scheduled K/V: advance each sequence (a tree: its root only, until
        acceptance) and hand the drafter the features of the positions that became final.
        Returns how many prompt tokens were computed."""
        num_prompt_tokens = 0
        for item, rows in zip(batch.scheduled, verified.token_rows):
            seq = item.seq
            num_final = 1 if seq.seq_id in trees else item.num_new_tokens
            start = seq.num_computed_tokens
            num_prompt_tokens += max(0, min(start + num_final, seq.prompt_len) - start)
            seq.num_computed_tokens += num_final
            self.drafter.commit(seq, verified.features[rows.start : rows.start + num_final])
        return num_prompt_tokens

    @staticmethod
    def _mark_scheduled(batch: SchedulerOutput, now: float) -> None:
        for item in batch.scheduled:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now

    def _accept(
        self, batch: SchedulerOutput, trees: dict[int, DraftTree], verified: ForwardOutput
    ) -> list[_Verdict]:
        """Decide each sampling sequence's new tokens; an n > 1 request forks its choices here."""
        verdicts: list[_Verdict] = []
        for item, row, token_rows in zip(
            batch.scheduled, verified.logits_rows, verified.token_rows
        ):
            if row is not None:
                tree = trees.get(item.seq.seq_id)
                for member in [item.seq, *self._fork_pending_choices(item.seq)]:
                    verdicts.append(_Verdict(member, tree, row, token_rows))
        decisions = self.drafter.accept(
            [v.seq for v in verdicts],
            [v.tree for v in verdicts],
            verified,
            [v.logits_row for v in verdicts],
            [v.token_rows for v in verdicts],
        )
        for verdict, decision in zip(verdicts, decisions):
            verdict.accepted = decision
        return verdicts

    def _fork_pending_choices(self, seq: Sequence) -> list[Sequence]:
        request, children = seq.request, []
        while request.num_pending_choices:
            index = len(request.sequences)
            child = seq.fork(next(self._seq_ids), index, self._generator(request.params, index))
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child, after=children[-1] if children else seq)
            request.sequences.append(child)
            children.append(child)
        return children

    def _commit(
        self,
        batch: SchedulerOutput,
        trees: dict[int, DraftTree],
        verdicts: list[_Verdict],
        verified: ForwardOutput,
    ) -> tuple[list[RequestOutput], float]:
        """Append each sequence's new tokens and end those that stopped; the drafter then settles
        the live sequences that did not draft, before their outputs leave the engine. Returns the
        deltas and the seconds the drafter took (the step's head work, like propose's)."""
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for verdict in verdicts:
            seq, accepted = verdict.seq, verdict.accepted
            if verdict.tree is not None:
                self._commit_accepted_drafts(verdict, verified)
            if seq.num_output_tokens > 0:
                seq.num_decode_steps += 1
            for token_id, logprob in zip(accepted.token_ids, accepted.logprobs):
                status = append_token(seq, token_id, logprob)
                verdict.num_emitted += 1
                if seq.grammar is not None:
                    seq.grammar.advance([token_id])
                if status is not None:
                    self.scheduler.finish(seq, status)
                    break
            touched.setdefault(seq.request.request_id, []).append(seq)
        stepped = dict.fromkeys([*(i.seq for i in batch.scheduled), *(v.seq for v in verdicts)])
        live = [seq for seq in stepped if not seq.is_finished]
        settling = time.perf_counter()
        self.drafter.settle([seq for seq in live if seq.seq_id not in trees])
        settle_seconds = time.perf_counter() - settling
        for seq in live:
            self.block_manager.trim(seq, seq.num_tokens)  # the draft scratch goes back
            self.block_manager.cache_computed_blocks(seq)
        return self._request_deltas(touched, now), settle_seconds

    def _commit_accepted_drafts(self, verdict: _Verdict, verified: ForwardOutput) -> None:
        """Move the accepted nodes' K/V from their scratch slots into place after the root, and
        hand their target features to the drafter."""
        seq, tree, nodes = verdict.seq, verdict.tree, verdict.accepted.accepted_nodes
        seq.num_draft_tokens += tree.num_draft_tokens
        seq.num_accepted_tokens += len(nodes)
        if not nodes:
            return
        root = seq.num_computed_tokens - 1  # the root's entry; node n sits at root + n
        moves = [
            (root + node, root + depth)
            for depth, node in enumerate(nodes, start=1)
            if node != depth
        ]
        if moves:
            self.runner.kv_cache.move_slots(
                [self._slot(seq, s) for s, _ in moves],
                [self._slot(seq, d) for _, d in moves],
                self.spec.num_layers,
            )
        seq.num_computed_tokens += len(nodes)
        rows = [verdict.token_rows.start + node for node in nodes]
        self.drafter.commit(seq, verified.features[rows])

    def _slot(self, seq: Sequence, entry: int) -> int:
        block_size = self.config.block_size
        return seq.block_table[entry // block_size] * block_size + entry % block_size

    def _request_deltas(self, touched: dict[str, list[Sequence]], now: float):
        outputs = []
        for request_id, seqs in touched.items():
            request = self.requests[request_id]
            self._record_token_times(request.metrics, seqs, now)
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request_id]
                self._finished_stats.append(_finished_stats(request))
            outputs.append(self._delta(request, seqs))
        return outputs

    # ----------------------------------------------------------------- outputs
    def _delta(self, request: Request, seqs: Iterable[Sequence]) -> RequestOutput:
        metrics = request.metrics
        metrics.num_decode_steps = sum(s.num_decode_steps for s in request.sequences)
        metrics.num_draft_tokens = sum(s.num_draft_tokens for s in request.sequences)
        metrics.num_accepted_tokens = sum(s.num_accepted_tokens for s in request.sequences)
        outputs = [_completion_delta(seq) for seq in seqs]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished=request.finished,
            metrics=metrics,
        )

    def _record_token_times(
        self, metrics: RequestMetrics, seqs: list[Sequence], now: float
    ) -> None:
        """Token times, and this step's TTFT and inter-token latency samples (see StepStats);
        the n choices of a request decode side by side, so its delta counts its longest one."""
        num_new = max(s.num_output_tokens - s.num_emitted_tokens for s in seqs)
        if num_new == 0:
            return
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self._ttfts.append(now - metrics.arrival_time)
        elif metrics.last_token_time is not None:
            self._itls.extend([(now - metrics.last_token_time) / num_new] * num_new)
        metrics.last_token_time = now

    def _emit_stats(self, batch: SchedulerOutput, verdicts: list[_Verdict], **measured) -> None:
        """One StepStats to each listener: the batch's and verdicts' counts, with what the step
        measured of itself as StepStats' own keyword fields (an abort's: prompt tokens only)."""
        finished, self._finished_stats = tuple(self._finished_stats), []
        ttfts, itls, self._ttfts, self._itls = tuple(self._ttfts), tuple(self._itls), [], []
        if not self.stats_listeners:
            return
        drafted = [v for v in verdicts if v.tree is not None]
        accepted_per_position = [0] * max(
            (len(v.accepted.accepted_nodes) for v in drafted), default=0
        )
        for verdict in drafted:
            for position in range(len(verdict.accepted.accepted_nodes)):
                accepted_per_position[position] += 1
        stats = StepStats(
            timestamp=time.time(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_generation_tokens=sum(v.num_emitted for v in verdicts),
            num_preemptions=len(batch.preempted),
            num_prefix_cache_queries=batch.num_cache_queried_tokens,
            num_prefix_cache_hits=batch.num_cache_hit_tokens,
            num_drafts=len(drafted),
            num_draft_tokens=sum(v.tree.num_draft_tokens for v in drafted),
            num_accepted_tokens=sum(accepted_per_position),
            accepted_per_position=tuple(accepted_per_position),
            tokens_per_pass=tuple(v.num_emitted for v in drafted),
            time_to_first_tokens_s=ttfts,
            inter_token_latencies_s=itls,
            finished=finished,
            **measured,
        )
        for listener in self.stats_listeners:
            listener(stats)

    # ----------------------------------------------------------------- helpers
    def _new_sequence(self, request: Request, index: int) -> Sequence:
        detokenizer = IncrementalDetokenizer.for_prompt(
            self.tokenizer, len(request.prompt_token_ids), request.params.skip_special_tokens
        )
        return Sequence(
            next(self._seq_ids),
            request,
            index,
            list(request.prompt_token_ids),
            len(request.prompt_token_ids),
            detokenizer,
            self._generator(request.params, index),
            grammar=request.grammar.matcher() if request.grammar else None,
            num_head_computed_tokens=0 if self.config.draft else None,
        )

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Seeded requests sample from their own stream; choice j of n uses seed + j."""
        if params.seed is None:
            return None
        seed = (params.seed + index) % 2**64  # torch takes unsigned 64-bit seeds
        return torch.Generator(self.runner.device).manual_seed(seed)

    def _unforked_abort(self, request: Request, index: int) -> Sequence:
        seq = self._new_sequence(request, index)
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq


def _completion_delta(seq: Sequence) -> CompletionOutput:
    """The part of `seq`'s output not yet handed out; text that may become a stop string waits."""
    params = seq.request.params
    tokens = seq.output_token_ids[seq.num_emitted_tokens :]
    end = (
        len(seq.text)
        if seq.is_finished
        else len(seq.text) - held_back_length(seq.text, params.stop)
    )
    text = seq.text[seq.num_emitted_chars : end] if end > seq.num_emitted_chars else ""
    logprobs = seq.logprobs[seq.num_emitted_logprobs :] if params.logprobs is not None else None
    seq.num_emitted_tokens += len(tokens)
    seq.num_emitted_chars = max(seq.num_emitted_chars, end)
    seq.num_emitted_logprobs = len(seq.logprobs)
    return CompletionOutput(
        seq.index, text, tokens, seq.status.finish_reason, seq.stop_reason, logprobs
    )


def _finished_stats(request: Request) -> FinishedRequestStats:
    m = request.metrics
    reasons = [s.status.finish_reason for s in request.sequences]
    end = m.finished_time or time.monotonic()
    return FinishedRequestStats(
        finish_reason="stop" if "stop" in reasons else reasons[0],
        num_prompt_tokens=m.num_prompt_tokens,
        num_generation_tokens=sum(s.num_output_tokens for s in request.sequences),
        queue_time_s=(m.first_scheduled_time or end) - m.arrival_time,
        ttft_s=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
        e2e_latency_s=end - m.arrival_time,
    )


def _max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The context length served. Without chunked prefill a whole sequence must fit in one step's
    token budget (its prefill, or its recompute after preemption), so the budget caps it."""
    max_len = spec.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise InvalidRequestError(
                f"max_model_len {config.max_model_len} exceeds the model's context of "
                f"{max_len} tokens"
            )
        max_len = config.max_model_len
    if not config.enable_chunked_prefill:
        max_len = min(max_len, config.max_num_batched_tokens)
    return max_len


def _eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
