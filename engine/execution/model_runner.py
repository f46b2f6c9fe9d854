"""ModelRunner: owns the target model and the KV cache, and runs one batched forward per step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.draft_tree import DraftTree
from engine.core.kv_cache import KVCache, LayerShape
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.execution.compilation import compile_model, warm_up
from engine.execution.layers.cpu_kernels import (
    CpuKernels,
    can_use_cpu_kernels,
    load_cpu_kernels,
    use_cpu_kernels,
)
from engine.execution.layers.cpu_linear import LinearKernels, use_cpu_linears
from engine.execution.layers.flash_attention import (
    build_flash_attention_metadata,
    flash_supports,
    load_flash_kernel,
    select_attention_backend,
)
from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from engine.execution.linear_kernels import choose_linear_kernels
from engine.execution.models.decoder import DecoderModel
from engine.execution.models.spec import ModelSpec
from engine.execution.verify_cost import VerifyCost, node_logits_with_pass

logger = logging.getLogger(__name__)

_BYTES_PER_GIB = 1 << 30
SYNTHETIC_CONTEXT = 64  # cached entries before the new tokens of a synthetic pass
# A compiled model runs each sequence with more new tokens than this (a prefill chunk) in a pass
# of its own: it pads every sequence of a pass to the longest, and a padded query row costs about
# as much as a real one, while a pass's extra read of the weights is small beside a chunk's compute.
_LONG_QUERY = 16


@dataclass(frozen=True)
class ForwardOutput:
    """One verify pass. Rows of `hidden` follow the scheduled tokens in order; `logits` has a row
    per sampling sequence: its last token's, or its draft tree's root's. The logits of a tree's
    other nodes come with the pass (`tree_logits`) when that costs less than the walks' own calls
    would (`node_logits_with_pass`); otherwise they are computed on demand (`node_logits`): an
    acceptance walk reads only the nodes it reaches (and, where they are few, the nodes below
    them), and on a CPU the lm_head is dear (113 MB of fp32 weights for the default model: a call
    costs a seventh of a one-token pass)."""

    logits: torch.Tensor  # [R, vocab] float32
    hidden: torch.Tensor  # [T, hidden] final hidden states of every computed token
    features: torch.Tensor  # [T, F] what the drafter learns from (`DecoderModel.split_features`)
    token_rows: list[range]  # per scheduled sequence: its rows of `hidden` (a tree's: its nodes)
    logits_rows: list[int | None]  # per scheduled sequence: its row of `logits` (None: none)
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] -> [N, vocab] float32
    tree_logits: dict[int, torch.Tensor]  # row of `hidden` -> [vocab]: tree nodes' logits, if here

    @torch.inference_mode()
    def node_logits(self, hidden_rows: list[int]) -> torch.Tensor:  # [N, vocab] float32
        return self.lm_head(self.hidden[torch.tensor(hidden_rows, device=self.hidden.device)])


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        hf_config,
        state_dict,
        max_model_len: int,
        extra_layers: tuple[LayerShape, ...] = (),
        feature_layers: tuple[int, ...] = (),  # layers whose input a draft head reads (EAGLE-3)
    ) -> None:
        self.config, self.spec = config, spec
        self.device, self.dtype = config.torch_device, config.torch_dtype
        inv_freq, scaling = rope_inverse_frequencies(hf_config, spec.head_dim)
        rotary = RotaryEmbedding(inv_freq, scaling, max_model_len)
        self.model = DecoderModel.from_state_dict(spec, rotary, state_dict, self.device, self.dtype)
        self.model.feature_layers = tuple(feature_layers)
        layers = [LayerShape(spec.num_kv_heads, spec.head_dim)] * spec.num_layers
        layers += list(extra_layers)
        self.num_blocks = self._num_kv_blocks(layers)
        self.kv_cache = KVCache(layers, self.num_blocks, config.block_size, self.dtype, self.device)
        backend = select_attention_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            spec.head_dim,
            compiled=config.enable_torch_compile,
        )
        logger.info("attention backend: %s", backend)
        # flash-attn's varlen kernel when the flash backend serves this model, else None
        self.flash_kernel = load_flash_kernel() if backend == "flash" else None
        self.forward = self.model  # [T] ids, [T] positions, K/V, metadata -> [T, F']
        # how every CpuLinear of this engine runs, measured below (execution/linear_kernels.py)
        self.linear_kernels = LinearKernels()
        # the passes' and the lm_head's measured cost, once the engine has it (for the draft
        # budget); it decides whether a verify pass brings its tree nodes' logits
        self.verify_cost: VerifyCost | None = None
        # the fused CPU kernels every layer of this engine calls (the head's too), or None
        self.cpu_kernels: CpuKernels | None = None
        if config.enable_torch_compile:  # inductor freezes the weights into its graphs
            self.forward = compile_model(self.model)
            warm_up(self)
        else:
            if config.fused_cpu_kernels and can_use_cpu_kernels(self.model):
                self.cpu_kernels = load_cpu_kernels()
                use_cpu_kernels(self.model, self.cpu_kernels)
            use_cpu_linears(self.model, self.linear_kernels)
            choose_linear_kernels(self, self.linear_kernels, config.pad_linear_passes)

    def _num_kv_blocks(self, layers: list[LayerShape]) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = KVCache.bytes_per_block(layers, self.config.block_size, self.dtype)
        return max(1, int(self.config.kv_cache_memory_gib * _BYTES_PER_GIB) // per_block)

    @torch.inference_mode()
    def execute(
        self, batch: SchedulerOutput, trees: dict[int, DraftTree] | None = None
    ) -> ForwardOutput:
        """Compute the scheduled tokens' K/V (draft trees' into scratch slots after the root), and
        logits where a token is sampled."""
        trees = trees or {}
        self.kv_cache.copy_blocks(batch.block_copies)
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []  # rows of `hidden` whose logits are computed now
        sequences, token_rows, logits_rows = [], [], []
        for item in batch.scheduled:
            tree = trees.get(item.seq.seq_id)
            ids, pos, attention = _inputs(item, tree)
            rows = range(len(input_ids), len(input_ids) + len(ids))
            token_rows.append(rows)
            if tree or item.samples:
                logits_rows.append(len(sample_rows))
                sample_rows.append(rows[0] if tree else rows[-1])  # a tree's root comes first
            else:
                logits_rows.append(None)
            input_ids += ids
            positions += pos
            sequences.append(attention)
        output = self._forward_passes(input_ids, positions, sequences, token_rows)  # [T, F']
        hidden, features = self.model.split_features(output)  # [T, hidden], [T, F]
        node_rows = [  # every tree's nodes but its root
            r
            for item, rows in zip(batch.scheduled, token_rows)
            if item.seq.seq_id in trees
            for r in rows[1:]
        ]
        if node_rows and not node_logits_with_pass(
            self.verify_cost, len(sample_rows), len(node_rows), len(trees)
        ):
            node_rows = []  # the acceptance walks compute what they reach (`node_logits`)
        picked = torch.tensor(sample_rows + node_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[picked])  # [R + N, vocab]
        return ForwardOutput(
            logits[: len(sample_rows)],
            hidden,
            features,
            token_rows,
            logits_rows,
            self.model.compute_logits,
            dict(zip(node_rows, logits[len(sample_rows) :])),
        )

    @torch.inference_mode()
    def synthetic_pass(self, num_tokens: int, tokens_per_sequence: int) -> None:
        """A verify-shaped pass over junk tokens, to measure its cost: sequences of
        `tokens_per_sequence` new tokens after a short context, logits on each one's first row
        (its root). Every sequence reads and writes the same scratch blocks, so only use it while
        nothing runs."""
        block_size = self.config.block_size
        context = max(0, min(SYNTHETIC_CONTEXT, self.num_blocks * block_size - tokens_per_sequence))
        blocks = list(
            range(min(self.num_blocks, -(-(context + tokens_per_sequence) // block_size)))
        )
        full, rest = divmod(num_tokens, tokens_per_sequence)
        sizes = [tokens_per_sequence] * full + ([rest] if rest else [])
        meta = self._attention_metadata([SequenceAttention(blocks, context, n) for n in sizes])
        positions = torch.cat([torch.arange(context, context + n) for n in sizes])  # [T]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)  # [T]
        output = self.forward(ids, positions.to(self.device), self.kv_cache.layers, meta)
        hidden, _ = self.model.split_features(output)  # [T, hidden]
        self.model.compute_logits(hidden[::tokens_per_sequence])  # [B, vocab]
        self._synchronize()

    @torch.inference_mode()
    def logits_pass(self, num_rows: int) -> None:
        """The lm_head over `num_rows` rows: what an acceptance walk spends on the nodes it
        reaches."""
        rows = self.model.embed_tokens.weight[:num_rows]  # [N, hidden]
        self.model.compute_logits(rows)  # [N, vocab]
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_passes(
        self,
        input_ids: list[int],
        positions: list[int],
        sequences: list[SequenceAttention],
        token_rows: list[range],
    ) -> torch.Tensor:  # [T, hidden]
        """The model over the step's tokens, in one pass or (compiled) several."""
        passes = self._passes(sequences)
        if len(passes) == 1:
            return self._forward(input_ids, positions, sequences)
        outputs, rows = [], []
        for members in passes:
            pass_rows = [r for i in members for r in token_rows[i]]
            outputs.append(
                self._forward(
                    [input_ids[r] for r in pass_rows],
                    [positions[r] for r in pass_rows],
                    [sequences[i] for i in members],
                )
            )  # [T_p, hidden]
            rows += pass_rows
        order = torch.tensor(rows, device=self.device).argsort()  # [T] each token's stacked row
        return torch.cat(outputs)[order]

    def _passes(self, sequences: list[SequenceAttention]) -> list[list[int]]:
        """Sequences per forward pass. A compiled model (one attention group, see
        `_attention_metadata`) runs each prefill chunk in a pass of its own, so that neither the
        decodes nor a shorter chunk are padded to a chunk's length."""
        everyone = list(range(len(sequences)))
        if not self.config.enable_torch_compile:
            return [everyone]
        short = [i for i in everyone if sequences[i].num_new <= _LONG_QUERY]
        long = [[i] for i in everyone if sequences[i].num_new > _LONG_QUERY]
        return [short, *long] if short else long

    def _forward(self, input_ids, positions, sequences) -> torch.Tensor:  # [T, hidden]
        return self.forward(
            torch.tensor(input_ids, device=self.device),  # [T]
            torch.tensor(positions, device=self.device),  # [T]
            self.kv_cache.layers,
            self._attention_metadata(sequences),
        )

    def _attention_metadata(self, sequences: list[SequenceAttention]):
        window = self.spec.sliding_window
        if self.flash_kernel is not None and flash_supports(sequences, window):
            return build_flash_attention_metadata(
                sequences, self.config.block_size, self.device, self.flash_kernel, window
            )
        # A compiled model keeps one attention group: its graphs must not vary with their number.
        return build_attention_metadata(
            sequences,
            self.config.block_size,
            self.device,
            self.spec.sliding_window,
            group_queries=not self.config.enable_torch_compile,
        )


def _inputs(item: ScheduledSequence, tree: DraftTree | None):
    """Token ids, positions and attention of one scheduled sequence."""
    seq, start = item.seq, item.seq.num_computed_tokens
    if tree is None:
        end = start + item.num_new_tokens
        ids = seq.token_ids[start:end]
        return ids, list(range(start, end)), SequenceAttention(seq.block_table, start, len(ids))
    positions = tree.positions(start)
    attention = SequenceAttention(
        seq.block_table, start, tree.num_nodes, tree_mask=tree.ancestor_mask(), positions=positions
    )
    return list(tree.tokens), positions, attention
