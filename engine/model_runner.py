"""ModelRunner: owns the target model and its KV cache, and runs one batched forward per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from engine.models.decoder import DecoderModel
from engine.models.spec import ModelSpec
from engine.scheduler import SchedulerOutput

_BYTES_PER_GIB = 1 << 30


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, one row per sampling sequence, in schedule order
    hidden: torch.Tensor  # [N, hidden] final features of the same rows


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, hf_config, state_dict, max_model_len):
        self.config, self.spec = config, spec
        self.device, self.dtype = config.torch_device, config.torch_dtype
        inv_freq, scaling = rope_inverse_frequencies(hf_config, spec.head_dim)
        rotary = RotaryEmbedding(inv_freq, scaling, max_model_len)
        self.model = DecoderModel.from_state_dict(spec, rotary, state_dict, self.device, self.dtype)
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache(
            spec.num_layers,
            self.num_blocks,
            config.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            self.dtype,
            self.device,
        )

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = KVCache.bytes_per_block(
            self.spec.num_layers,
            self.config.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.dtype,
        )
        return max(1, int(self.config.kv_cache_memory_gib * _BYTES_PER_GIB) // per_block)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ForwardOutput:
        """Compute the scheduled tokens' K/V, and logits and features where a token is sampled."""
        self.kv_cache.copy_blocks(batch.block_copies)
        input_ids, positions, sample_rows = [], [], []
        sequences = []
        for item in batch.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + item.num_new_tokens]
            positions += range(start, start + item.num_new_tokens)
            sequences.append(SequenceAttention(seq.block_table, start, item.num_new_tokens))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        meta = build_attention_metadata(
            sequences, self.config.block_size, self.device, self.spec.sliding_window
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),  # [T]
            torch.tensor(positions, device=self.device),  # [T]
            self.kv_cache.layers,
            meta,
        )  # [T, hidden]
        hidden = hidden[
            torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        ]  # [N, hidden]
        return ForwardOutput(self.model.compute_logits(hidden), hidden)
