"""The EAGLE-1/2 training objective and one optimisation step over a batch of sequences.

For each position i the head reads token i + 1 and the target's feature at i (plus small uniform
noise) and predicts the feature at i + 1. Loss: smooth-L1 to that feature (weight 1.0) plus the
cross-entropy between the target's next-token distribution and the head's, both through the frozen
lm_head (weight 0.1), on the positions the loss mask keeps (assistant tokens).

A head with a reduced draft vocabulary only ever scores those tokens, so its cross-entropy uses
only their lm_head rows (both distributions renormalised over them). For a small target this is
most of the training cost saved: the full lm_head is several times the head itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafting.features import scratch_attention
from drafting.head import EagleHead
from engine.models.decoder import DecoderModel

FEATURE_WEIGHT = 1.0
TOKEN_WEIGHT = 0.1


@dataclass(frozen=True)
class TrainingExample:
    token_ids: torch.Tensor  # [T] long
    features: torch.Tensor  # [T, hidden] target features
    loss_mask: torch.Tensor  # [T] bool: positions whose next token is trained on


@dataclass(frozen=True)
class StepLosses:
    feature: float
    token: float
    accuracy: float  # how often the head's top token equals the target's


def head_losses(
    head: EagleHead, target: DecoderModel, batch: list[TrainingExample], noise: float = 0.2
) -> tuple[torch.Tensor, StepLosses]:
    """The weighted loss (for backward) and its parts, for a batch of examples."""
    lengths = [len(e.token_ids) - 1 for e in batch]  # position i predicts i + 1
    device = head.fc.weight.device
    cache, meta = scratch_attention(lengths, [head.kv_layer_shape], head.fc.weight.dtype, device)
    next_tokens = torch.cat([e.token_ids[1:] for e in batch]).to(device)  # [N]
    features = torch.cat([e.features[:-1] for e in batch]).to(device).float()  # [N, hidden]
    targets = torch.cat([e.features[1:] for e in batch]).to(device).float()  # [N, hidden]
    mask = torch.cat([e.loss_mask[:-1] for e in batch]).to(device)  # [N]
    features = features + (torch.rand_like(features) - 0.5) * noise
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    predicted = head(
        next_tokens, features, positions, cache.layers[0], meta, target.embed_tokens
    )  # [N, hidden]
    predicted, targets = predicted[mask], targets[mask]
    feature_loss = F.smooth_l1_loss(predicted, targets)
    weight = target.lm_head.weight  # [vocab, hidden]
    if head.draft_vocab is not None:
        weight = weight[head.draft_vocab]  # [V_draft, hidden]
    with torch.no_grad():
        target_probs = torch.softmax(F.linear(targets, weight).float(), dim=-1)  # [M, V]
    head_logprobs = torch.log_softmax(F.linear(predicted, weight).float(), dim=-1)  # [M, V]
    token_loss = -(target_probs * head_logprobs).sum(-1).mean()
    with torch.no_grad():
        accuracy = (head_logprobs.argmax(-1) == target_probs.argmax(-1)).float().mean()
    loss = FEATURE_WEIGHT * feature_loss + TOKEN_WEIGHT * token_loss
    parts = StepLosses(feature_loss.item(), token_loss.item(), accuracy.item())
    return loss, parts
