"""The EAGLE training objectives, optionally unrolled over several drafting steps.

For each position i the head reads token i + 1 and the target's feature at i (plus small uniform
noise) and predicts the feature at i + 1. EAGLE-1/2 loss: smooth-L1 to that feature (weight 1.0)
plus the cross-entropy between the target's next-token distribution and the head's, both through
the frozen lm_head (weight 0.1). EAGLE-3 loss: the cross-entropy, the head's distribution
through its own norm and lm_head over its draft vocabulary, its features the target's three
layers' states (projected by its fc before the first step); the feature regression is off unless
asked for (`feature_weight`), and then compares the head's normed output with the target's
final-normed state, the space both lm_heads read. Both on the positions the loss mask keeps
(assistant tokens).

When drafting, only the first level of a tree reads a target feature: deeper nodes read the head's
own prediction of their parent's feature, and attend to their ancestors' K/V, which were computed
from predictions too. `unroll_steps` > 1 trains that situation (the "training-time test" of HASS
and EAGLE-3): step s feeds each position the head's step s - 1 prediction for it, and attends to
the target-fed entries up to its tree's root plus the one entry per earlier step on its own draft
path, exactly as a draft chain of depth s would. Step s's loss is weighted `UNROLL_DECAY ** s`.

A head with a reduced draft vocabulary only ever scores those tokens, so its cross-entropy uses
only their lm_head rows (both distributions renormalised over them). For a small target this is
most of the training cost saved: the full lm_head is several times the head itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafting.eagle3_head import Eagle3Head
from drafting.head_loader import DraftHead
from engine.core.kv_cache import KVCache
from engine.execution.layers.paged_attention import (
    AttentionMetadata,
    SequenceAttention,
    build_attention_metadata,
)
from engine.execution.models.decoder import DecoderModel

TOKEN_WEIGHT = 0.1
UNROLL_DECAY = 0.8


@dataclass(frozen=True)
class TrainingExample:
    token_ids: torch.Tensor  # [T] long
    features: torch.Tensor  # [T, F] the target's output (`DecoderModel.split_features`)
    loss_mask: torch.Tensor  # [T] bool: positions whose next token is trained on


@dataclass(frozen=True)
class StepLosses:
    feature: float  # of the first step
    token: float  # of the first step
    accuracy: tuple[float, ...]  # per step: how often the head's top token equals the target's


def head_losses(
    head: DraftHead,
    target: DecoderModel,
    batch: list[TrainingExample],
    noise: float = 0.2,
    unroll_steps: int = 1,
    feature_weight: float | None = None,  # None: the head format's (default_feature_weight)
) -> tuple[torch.Tensor, StepLosses]:
    """The weighted loss (for backward) and its parts, for a batch of examples."""
    lengths = [len(e.token_ids) - 1 for e in batch]  # position i predicts i + 1
    device = head.fc.weight.device
    next_tokens = torch.cat([e.token_ids[1:] for e in batch]).to(device)  # [N]
    output = torch.cat([e.features for e in batch]).to(device).float()  # [sum(T), F']
    hidden, features = target.split_features(output)  # [sum(T), hidden], [sum(T), F]
    firsts, lasts = _ends(lengths, device)
    features = features[~lasts]  # [N, F] position i's, for i < T - 1
    targets = hidden[~firsts]  # [N, hidden] the final hidden state at i + 1
    mask = torch.cat([e.loss_mask[:-1] for e in batch]).to(device)  # [N]
    features = features + (torch.rand_like(features) - 0.5) * noise
    features = head.project_features(features)  # [N, hidden] (EAGLE-3: through its fc)
    predictions = unrolled_predictions(
        head, target.embed_tokens, next_tokens, features, lengths, unroll_steps
    )  # unroll_steps x [N, hidden]
    score = _draft_scorer(head, target)
    if feature_weight is None:
        feature_weight = default_feature_weight(head)
    positions = _positions(lengths, device)[mask]  # [M] of the trained rows
    targets = targets[mask]  # [M, hidden]
    with torch.no_grad():  # the same targets at every step: their distribution once
        target_probs = torch.softmax(F.linear(targets, score.target_weight).float(), dim=-1)
    loss, parts = 0.0, []
    for step, predicted in enumerate(predictions):
        valid = positions >= step  # [M] step s's first s positions have no drafted input
        feature_loss, token_loss, accuracy = _losses(
            predicted[mask][valid], targets[valid], target_probs[valid], score, head
        )
        loss = loss + UNROLL_DECAY**step * (
            feature_weight * feature_loss + TOKEN_WEIGHT * token_loss
        )
        parts.append((feature_loss.item(), token_loss.item(), accuracy))
    (feature, token, _), accuracies = parts[0], tuple(a for _, _, a in parts)
    return loss, StepLosses(feature, token, accuracies)


def default_feature_weight(head: DraftHead) -> float:
    """The feature regression's weight in each format's published recipe: EAGLE-1/2 train on it
    (1.0, ten times the token loss's 0.1), EAGLE-3 drops it."""
    return 0.0 if isinstance(head, Eagle3Head) else 1.0


def _ends(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[sum(T)] bool masks of each sequence's first and last row (T = length + 1 each)."""
    sizes = torch.tensor([n + 1 for n in lengths], device=device)
    ends = sizes.cumsum(0)  # [B] one past each sequence's last row
    firsts = torch.zeros(int(ends[-1]), dtype=torch.bool, device=device)
    lasts = firsts.clone()
    firsts[ends - sizes] = True
    lasts[ends - 1] = True
    return firsts, lasts


@dataclass(frozen=True)
class _DraftScorer:
    """Logits over the draft vocabulary: the head's, from its predicted features, and the
    target's, from its own final hidden states (the target's lm_head rows of that vocabulary)."""

    head_logits: Callable[[torch.Tensor], torch.Tensor]  # [M, hidden] -> [M, V_draft]
    target_weight: torch.Tensor  # [V_draft, hidden]


def _draft_scorer(head: DraftHead, target: DecoderModel) -> _DraftScorer:
    weight = target.lm_head.weight  # [vocab, hidden]
    if head.draft_vocab is not None:
        weight = weight[head.draft_vocab]  # [V_draft, hidden]
    if isinstance(head, Eagle3Head):
        return _DraftScorer(head.draft_logits, weight)
    return _DraftScorer(lambda predicted: F.linear(predicted, weight), weight)


def _positions(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[sum(lengths)] each position's index in its own sequence."""
    return torch.cat([torch.arange(n) for n in lengths]).to(device)


def _losses(
    predicted: torch.Tensor,  # [M, hidden] the head's features
    targets: torch.Tensor,  # [M, hidden] the target's final hidden states
    target_probs: torch.Tensor,  # [M, V] the target's distribution over the draft vocabulary
    score: _DraftScorer,
    head: DraftHead,
):
    """Smooth-L1 to the target's states, soft cross-entropy over the draft vocabulary and top-1
    agreement."""
    comparable = head.norm(predicted) if isinstance(head, Eagle3Head) else predicted
    feature_loss = F.smooth_l1_loss(comparable, targets)
    head_logprobs = torch.log_softmax(score.head_logits(predicted).float(), dim=-1)  # [M, V]
    token_loss = -(target_probs * head_logprobs).sum(-1).mean()
    with torch.no_grad():
        accuracy = (head_logprobs.argmax(-1) == target_probs.argmax(-1)).float().mean().item()
    return feature_loss, token_loss, accuracy


def unrolled_predictions(
    head: DraftHead,
    target_embedding: torch.nn.Embedding,
    next_tokens: torch.Tensor,  # [N] token i + 1 of each position i, sequences concatenated
    features: torch.Tensor,  # [N, hidden] the (projected) target feature at each position
    lengths: list[int],  # positions per sequence
    steps: int,
) -> list[torch.Tensor]:  # steps x [N, hidden]: each step's predicted next features
    """The head's predictions at each drafting depth, every position taken as a draft path's end.

    Step s (0-based) at position i reads the head's step s - 1 prediction of feature i (made at
    position i - 1) and sees the target-fed entries up to i - s and, of each later step k, the entry
    at i - s + k. Its first s positions have no such input: they read the target feature, and no
    other position sees them.
    """
    device = features.device
    # a block per sequence and step: step s attends to its sequence's first s + 1 blocks only
    cache = KVCache(
        list(head.kv_layer_shapes), len(lengths) * steps, max(lengths), features.dtype, device
    )
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)  # [B] first position
    positions = _positions(lengths, device)  # [N]
    inputs, predictions = features, []
    for step in range(steps):
        meta = _unrolled_step_metadata(lengths, step, steps, cache.block_size, device)
        predicted = head(next_tokens, inputs, positions, cache.layers, meta, target_embedding)
        predictions.append(predicted)  # [N, hidden]
        inputs = torch.cat((features[:1], predicted[:-1]))  # [N, hidden] shifted one position
        inputs[starts] = features[starts]  # a sequence's first position has no predecessor
    return predictions


def _unrolled_step_metadata(
    lengths: list[int], step: int, steps: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Sequence b owns blocks b * steps onwards; step s writes its n entries after the s * n of
    earlier steps."""
    sequences = [
        # step 0 is the plain causal pass: the default mask, no tree mask to build
        SequenceAttention(
            list(range(b * steps, (b + 1) * steps)),
            step * n,
            n,
            tree_mask=_draft_path_mask(n, step) if step else None,
        )
        for b, n in enumerate(lengths)
    ]
    return build_attention_metadata(sequences, block_size, device)


def _draft_path_mask(n: int, step: int) -> torch.Tensor:  # [n, (step + 1) n]
    """Which entries of steps 0..step each of a sequence's n step-`step` queries sees."""
    position = torch.arange(n)[:, None]  # [n, 1] the query's position
    entry = torch.arange((step + 1) * n)[None, :]  # [1, (s + 1) n] keys of steps 0..s
    key_step, key_position = entry // n, entry % n
    return torch.where(
        key_step == 0,
        key_position <= position - step,  # the target-fed context up to the path's root
        key_position == position - step + key_step,  # the path's entry at each later step
    )
