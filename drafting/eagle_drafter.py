"""EagleDrafter: EAGLE-2 dynamic-tree drafting for every decoding sequence of a step, batched,
with an EAGLE-1/2 or an EAGLE-3 head (whose features are the target's three layers' states).

Propose: first the head catches up on the drafting sequences' positions whose target features
arrived since its last pass (the root and accepted tokens of their last step, or the tokens since
their last full block: `settle` stores the full blocks of the sequences that did not draft, at the
end of each step). Row i reads token i + 1 and the target's feature at i; a drafting sequence's
last row predicts the feature after the root, whose lm_head distribution gives the tree's first
layer. Each further layer runs the head once on the `top_k` best nodes of the newest layer (each
attending to the context and its own ancestors), then all candidates are reranked
(drafting/tree.py).

Head K/V of tree nodes goes to the sequence's scratch entries after its root: layer d's k rows
sit at root + (d - 1) * k + r. It is draft-only: the next catch-up overwrites it with real rows.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from drafting.acceptance import accept_at_node, accept_target_token
from drafting.eagle3_head import Eagle3Head
from drafting.head_loader import DraftHead
from drafting.tree import ROOT, Candidates, rerank
from engine.core.draft_tree import DraftTree
from engine.core.request import Sequence
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.execution.layers.cpu_linear import CpuLinear, can_use_cpu_linear
from engine.execution.layers.fp16_linear import Fp16Linear, can_use_fp16_linear
from engine.execution.layers.paged_attention import (
    SequenceAttention,
    build_attention_metadata,
    new_token_slots,
)
from engine.execution.model_runner import ForwardOutput
from engine.execution.models.decoder import DecoderModel
from engine.execution.verify_cost import FREE_LOGITS_ROWS
from engine.outputs import TokenLogprob
from engine.sampling.grammar import mask_logits, unpack_bitmask
from engine.sampling.logits_processing import apply_penalties, target_probabilities, token_logprobs
from engine.spec.draft_policy import DraftPolicy
from engine.spec.drafter import Accepted, logits_context, sample_one_each

# A sequence's rows before its newest, up to this many, run in the newest row's full head pass
# instead of a K/V-only pass of their own (a drafting step brings its accepted tokens: 0 to depth).
_FOLDED_ROWS = 8


@dataclass
class _TreeRows:
    """A sequence's head rows of this step: the candidate behind each, and their ancestor mask."""

    candidates: list[int] = field(default_factory=list)
    mask: torch.Tensor | None = None  # [rows, rows] bool

    def add(self, nodes: list[int], parents: list[int]) -> None:
        self.mask = _extend_ancestors(self.mask, self.candidates, parents)
        self.candidates += nodes


@dataclass
class _HeadRows:
    """Catch-up rows for one head pass: per sequence a run of positions [start, end), row i
    reading token i + 1 and the target's feature at i."""

    seq_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # [end - start, hidden] each
    attention: list[SequenceAttention] = field(default_factory=list)

    def add(self, seq: Sequence, start: int, end: int, features: torch.Tensor) -> None:
        if end <= start:
            return
        self.seq_ids.append(seq.seq_id)
        self.ids += seq.token_ids[start + 1 : end + 1]
        self.positions += range(start, end)
        self.features.append(features)
        self.attention.append(SequenceAttention(seq.block_table, start, end - start))

    def last_rows(self) -> list[int]:
        """The pass row of each sequence's last position."""
        return list(itertools.accumulate(a.num_new for a in self.attention))


@dataclass(frozen=True)
class TreeShape:
    top_k: int  # children per expanded node, and nodes expanded per layer
    depth: int  # draft layers
    total_tokens: int  # nodes verified, the root included

    @property
    def num_scratch(self) -> int:
        """Entries after the root a sequence needs: the verified nodes and the head's rows."""
        return max(self.total_tokens - 1, (self.depth - 1) * self.top_k)


class EagleDrafter:
    def __init__(
        self,
        head: DraftHead,
        target: DecoderModel,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],  # one per head layer
        block_size: int,
        shape: TreeShape,
        policy: DraftPolicy | None = None,
        fp16_weights: bool = False,
    ) -> None:
        self.head, self.target, self.kv_layers = head, target, kv_layers
        self.block_size, self.shape = block_size, shape
        self.policy = policy  # its budget keeps the nodes worth verifying; None: whole trees
        self.num_lookahead_tokens = shape.num_scratch
        self.device = target.lm_head.weight.device
        # A reduced draft vocabulary scores only the target's most frequent tokens: its lm_head
        # rows are a fraction of the full one, which dominates drafting for small targets.
        self.draft_vocab = head.draft_vocab  # [V_draft] target token ids, or None
        self.draft_vocab_size = (
            len(self.draft_vocab) if self.draft_vocab is not None else target.spec.vocab_size
        )
        if isinstance(head, Eagle3Head):  # its own norm and lm_head over its draft vocabulary
            self.draft_logits = head.draft_logits
        else:  # the target's lm_head (its draft-vocabulary rows); fp16: layers/fp16_linear.py
            self.draft_logits = _draft_lm_head(target.lm_head, self.draft_vocab, fp16_weights)

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, batch: SchedulerOutput) -> dict[int, DraftTree]:
        """Draft trees for the sequences scheduled with draft scratch (the policy chose them as
        it planned the step), after the head's K/V catches up on their pending rows in one
        batched pass. The other sequences' rows are stored by `settle`, so a step that drafts
        nothing runs no head at all here."""
        drafting = [item for item in batch.scheduled if item.num_lookahead > 0]
        roots = self._catch_up([item.seq for item in drafting])
        drafting = [item for item in drafting if item.seq.seq_id in roots]
        if not drafting:
            return {}
        root_features = torch.stack([roots[item.seq.seq_id] for item in drafting])  # [B, hidden]
        trees = self._grow(drafting, root_features, batch.num_new_tokens)
        return {item.seq.seq_id: tree for item, tree in zip(drafting, trees) if tree is not None}

    @torch.inference_mode()
    def settle(self, seqs: list[Sequence]) -> None:
        """Store the head K/V of each sequence's pending rows up to its last full KV block, the
        newest row (the one a drafting step starts from) excepted: a block joins the prefix cache
        once its K/V is final in every layer, as it does without a head, and features wait at
        most a block. The rows after it join the next drafting step's full pass. Runs at the end
        of the step that brought the features, before its outputs leave the engine: not at the
        next step's start, when the server is busy streaming those outputs."""
        rows = _HeadRows()
        for seq in seqs:
            start = seq.num_head_computed_tokens
            available = min(seq.num_computed_tokens, seq.num_tokens - 2)  # the newest row waits
            end = available // self.block_size * self.block_size
            if end > start:
                rows.add(seq, start, end, _take_pending(seq, end - start))
                seq.num_head_computed_tokens = end
        if rows.seq_ids:
            self._store_kv(rows)

    def _catch_up(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Run the head over each decoding sequence's pending rows; return its newest row's output
        [hidden] per sequence (its tree grows from there). No other row's output is read, so
        those rows only store their K/V (`EagleHead.store_kv`), but for a few before the newest
        (a drafting step's accepted tokens): they join the newest row's pass, which costs what a
        pass of one row does, rather than read fc's and qkv's weights for a second pass of their
        own."""
        stored, newest = _HeadRows(), _HeadRows()
        for seq in seqs:
            start = seq.num_head_computed_tokens
            end = min(seq.num_computed_tokens, seq.num_tokens - 1)
            if end <= start:
                continue
            features = _take_pending(seq, end - start)  # [end - start, hidden]
            last = end - 1  # the newest token's row
            if last - start <= _FOLDED_ROWS:
                last = start  # all of them in the full pass
            stored.add(seq, start, last, features[: last - start])
            newest.add(seq, last, end, features[last - start :])
            seq.num_head_computed_tokens = end
        if stored.seq_ids:
            self._store_kv(stored)
        if not newest.seq_ids:
            return {}
        hidden = self._run_head(
            newest.ids, torch.cat(newest.features), newest.positions, newest.attention
        )  # [T, hidden]
        return dict(zip(newest.seq_ids, hidden[[row - 1 for row in newest.last_rows()]]))

    def _store_kv(self, rows: _HeadRows) -> None:
        """The head's K/V of `rows`, without its output (nobody reads it); a head of several
        layers runs its full pass, as its upper layers' K/V need the outputs below."""
        if self.head.num_layers > 1:
            self._run_head(rows.ids, torch.cat(rows.features), rows.positions, rows.attention)
            return
        self.head.store_kv(
            torch.tensor(rows.ids, device=self.device),
            torch.cat(rows.features),
            torch.tensor(rows.positions, device=self.device),
            self.kv_layers,
            new_token_slots(rows.attention, self.block_size, self.device),
            self.target.embed_tokens,
        )

    def _grow(
        self, items: list[ScheduledSequence], root_features: torch.Tensor, num_pass_tokens: int
    ):
        """EAGLE-2 expansion and reranking for B sequences at once."""
        k, batch = self.shape.top_k, len(items)
        root_allowed, root_forced = self._allowed_drafts(items, lambda b: [[]])  # [B, 1, V]
        candidates = Candidates.first_layer(
            self._draft_logprobs(root_features, _rows(root_allowed)),
            k,
            self.draft_vocab,
            None if root_forced is None else root_forced[:, 0],
        )
        sources = root_features[:, None, :].expand(-1, k, -1)  # [B, M, hidden] drafting feature
        depths = [self._depth_for(item.num_lookahead) for item in items]
        rows = [_TreeRows() for _ in range(batch)]
        for layer in range(1, max(depths)):
            active = [b for b in range(batch) if depths[b] > layer]
            chosen = candidates.newest_layer_best(k)  # [B, k] candidate indices
            out = self._expand(items, active, layer, candidates, chosen, sources, rows)
            allowed, forced = self._allowed_drafts(
                items, functools.partial(_chosen_paths, candidates, chosen)
            )  # [B, k, V] and [B, k], or None
            logprobs = torch.full((batch, k, self.draft_vocab_size), -torch.inf, device=self.device)
            active_allowed = None if allowed is None else _rows(allowed[active])
            logprobs[active] = self._draft_logprobs(out, active_allowed).view(len(active), k, -1)
            # children of inactive rows: -inf
            if forced is not None:
                inactive = [b for b in range(batch) if depths[b] <= layer]
                forced[inactive] = -1
            candidates.add_children(chosen, logprobs, k, self.draft_vocab, forced)
            children_sources = out.new_zeros(batch, k, k, out.shape[-1])
            children_sources[active] = out.view(len(active), k, 1, -1).expand(-1, -1, k, -1)
            sources = torch.cat([sources, children_sources.flatten(1, 2)], dim=1)
        num_keep = [self._num_keep(item.num_lookahead, d) for item, d in zip(items, depths)]
        if root_allowed is not None:  # never propose what the grammar forbids
            num_finite = torch.isfinite(candidates.values).sum(dim=-1).tolist()
            num_keep = [min(n, f) for n, f in zip(num_keep, num_finite)]
        if self.policy is not None:
            values = _best_values(candidates, num_keep)
            num_keep = self.policy.budget.allocate(values, num_pass_tokens)
        roots = [item.seq.token_ids[-1] for item in items]
        trees = rerank(candidates, roots, num_keep)
        return [tree if tree.num_draft_tokens else None for tree in trees]

    def _expand(self, items, active, layer, candidates, chosen, sources, rows) -> torch.Tensor:
        """One head pass over the chosen nodes of layer `layer` of the active sequences."""
        k = self.shape.top_k
        ids, positions, attention, features = [], [], [], []
        for b in active:
            seq, root = items[b].seq, items[b].seq.num_computed_tokens
            nodes = chosen[b]
            ids += candidates.tokens[b, nodes].tolist()
            features.append(sources[b, nodes])  # [k, hidden] the features that drafted them
            positions += [root + layer - 1] * k  # a layer-d node's head row is at root + d - 1
            rows[b].add(nodes.tolist(), candidates.parents[b, nodes].tolist())
            attention.append(
                SequenceAttention(
                    seq.block_table, root + (layer - 1) * k, k, tree_mask=rows[b].mask[-k:]
                )
            )
        return self._run_head(ids, torch.cat(features), positions, attention)  # [A * k, hidden]

    def _run_head(self, ids, features, positions, attention) -> torch.Tensor:
        meta = build_attention_metadata(attention, self.block_size, self.device)
        return self.head(
            torch.tensor(ids, device=self.device),
            features,
            torch.tensor(positions, device=self.device),
            self.kv_layers,
            meta,
            self.target.embed_tokens,
        )

    def _draft_logprobs(
        self, features: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N, hidden] -> [N, V] draft log-probabilities over the draft vocabulary. With
        `allowed` ([N, V] bool, a grammar's mask), renormalised over the allowed tokens (-inf
        everywhere in a row that allows none)."""
        logits = self.draft_logits(features).float()  # [N, V]
        if allowed is None:
            return torch.log_softmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.where(allowed.any(dim=-1, keepdim=True), logprobs, float("-inf"))

    def _allowed_drafts(
        self, items: list[ScheduledSequence], paths
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """What each sequence's grammar allows after each of its P draft paths (`paths(b)`: lists
        of tokens after the root): [B, P, V] bool over the draft vocabulary (True throughout for
        unconstrained sequences), and [B, P] the token it forces there (-1: none), which is
        drafted with certainty, in the draft vocabulary or not. (None, None) when no sequence is
        constrained."""
        constrained = [b for b, item in enumerate(items) if item.seq.grammar is not None]
        if not constrained:
            return None, None
        drafts = {b: items[b].seq.grammar.drafts_along(paths(b)) for b in constrained}
        vocab = items[constrained[0]].seq.grammar.vocab_size
        num_paths = len(drafts[constrained[0]][1])
        allowed = torch.ones(len(items), num_paths, vocab, dtype=torch.bool)
        forced = torch.full((len(items), num_paths), -1, dtype=torch.long)
        for b, (bitmask, tokens) in drafts.items():
            allowed[b] = unpack_bitmask(bitmask, vocab)  # [P, vocab]
            forced[b] = torch.tensor(tokens)
        only = allowed.to(torch.uint8).argmax(dim=-1)  # [B, P] the first allowed token
        forced = torch.where(allowed.sum(dim=-1) == 1, only, forced)  # a lone allowed token
        is_allowed = allowed.gather(-1, forced.clamp(min=0)[..., None])[..., 0]  # [B, P]
        forced = torch.where(is_allowed, forced, -1)
        if self.draft_vocab is not None:
            allowed = allowed[:, :, self.draft_vocab.cpu()]  # [B, P, V_draft]
        return allowed.to(self.device), forced.to(self.device)

    def _depth_for(self, room: int) -> int:
        """Draft layers that fit in `room` scratch entries (the head's rows and the nodes)."""
        return max(1, min(self.shape.depth, room, 1 + room // self.shape.top_k))

    def _num_keep(self, room: int, depth: int) -> int:
        k = self.shape.top_k
        generated = k + (depth - 1) * k * k
        return min(self.shape.total_tokens - 1, room, generated)

    # ------------------------------------------------------------------ accept
    def accept(
        self,
        seqs: list[Sequence],
        trees: list[DraftTree | None],
        verified: ForwardOutput,
        logits_rows: list[int],
        token_rows: list[range],
    ) -> list[Accepted]:
        results: list[Accepted | None] = [None] * len(seqs)
        plain = [i for i, tree in enumerate(trees) if tree is None]
        sampled = sample_one_each(
            [seqs[i] for i in plain], verified.logits, [logits_rows[i] for i in plain]
        )
        for i, accepted in zip(plain, sampled):
            results[i] = accepted
        drafted = [i for i, tree in enumerate(trees) if tree is not None]
        walks = [_Walk(seqs[i], trees[i], token_rows[i].start) for i in drafted]
        root_logits = verified.logits[[logits_rows[i] for i in drafted]]  # [D, vocab]
        for i, accepted in zip(drafted, _walk_trees(walks, root_logits, verified)):
            results[i] = accepted
        return results

    # ------------------------------------------------------------------ commit
    def commit(self, seq: Sequence, features: torch.Tensor) -> None:
        seq.pending_features.append(features.clone())  # a copy: the pass's rows may go


def _take_pending(seq: Sequence, num_rows: int) -> torch.Tensor:
    """The first `num_rows` of `seq`'s pending features [num_rows, hidden], removed from it."""
    parts = seq.pending_features
    pending = parts[0] if len(parts) == 1 else torch.cat(parts)  # [pending rows, hidden]
    taken, rest = pending[:num_rows], pending[num_rows:]
    seq.pending_features = [rest] if len(rest) else []
    return taken


def _chosen_paths(candidates: Candidates, chosen: torch.Tensor, b: int) -> list[list[int]]:
    """Sequence b's draft paths to its chosen candidates (chosen: [B, k] indices)."""
    return [candidates.path(b, int(c)) for c in chosen[b]]


def _rows(allowed: torch.Tensor | None) -> torch.Tensor | None:
    """[B, P, V] -> [B * P, V], one row per drafted node."""
    return None if allowed is None else allowed.flatten(0, 1)


def _best_values(candidates: Candidates, num_keep: list[int]) -> torch.Tensor:
    """[B, M] each sequence's candidate values, best first, -inf past what it may keep."""
    ranked = candidates.values.sort(dim=-1, descending=True).values  # [B, M]
    ranks = torch.arange(ranked.shape[1], device=ranked.device)[None, :]  # [1, M]
    limit = torch.tensor(num_keep, device=ranked.device)[:, None]  # [B, 1]
    return ranked.masked_fill(ranks >= limit, float("-inf")).cpu()


@dataclass
class _Walk:
    """One sequence's acceptance walk down its tree, a node per level."""

    seq: Sequence
    tree: DraftTree
    root_row: int  # the root's row of the verify pass's hidden states (node n: root_row + n)
    node: int = 0  # where the walk stands
    accepted: list[int] = field(default_factory=list)  # accepted nodes, in order
    raw_logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] at each node visited
    bonus: int | None = None  # set when the walk ends
    children: list[list[int]] = field(init=False)  # of every node, best draft value first

    def __post_init__(self) -> None:
        self.children = self.tree.children()

    @property
    def params(self):
        return self.seq.request.params

    def step(self, raw: torch.Tensor, argmax: int, probs: torch.Tensor | None) -> bool:
        """Decide at the current node from its target distribution; True if the walk goes on."""
        if self.params.logprobs is not None:
            self.raw_logits.append(raw)
        children = self.children[self.node]
        if self.params.greedy:
            child, self.bonus = accept_target_token(self.tree, children, argmax)
        else:
            child, self.bonus = accept_at_node(self.tree, children, probs, self.seq.generator)
        if child is None:
            return False
        self.accepted.append(child)
        self.node = child
        return True

    def subtree(self) -> list[int]:
        """The current node and every node below it."""
        nodes = [self.node]
        for node in nodes:
            nodes += self.children[node]
        return nodes

    def result(self) -> Accepted:
        tokens = [self.tree.tokens[n] for n in self.accepted] + [self.bonus]
        return Accepted(tokens, _emitted_logprobs(self, tokens), self.accepted)


def _walk_trees(
    walks: list[_Walk], root_logits: torch.Tensor, verified: ForwardOutput
) -> list[Accepted]:
    """Walk every tree, level by level (root_logits: [W, vocab] raw, at each root). The target
    logits of the nodes reached at one level come with the verify pass when the trees are small,
    or else are computed in one batch, with those of every node below them when they are few
    (`_node_logits`)."""
    active, logits = walks, root_logits  # logits: [A, vocab] at each active walk's node
    computed = dict(verified.tree_logits)  # hidden row -> [vocab] raw target logits
    while active:
        processed = _constrained(active, _penalised(active, logits), logits)
        argmax = processed.argmax(dim=-1).tolist()
        probs = _sampling_probabilities(active, processed)
        active = [
            walk for i, walk in enumerate(active) if walk.step(logits[i], argmax[i], probs.get(i))
        ]
        if active:
            logits = _node_logits(active, verified, computed)
    return [walk.result() for walk in walks]


def _sampling_probabilities(walks: list[_Walk], processed: torch.Tensor) -> dict[int, torch.Tensor]:
    """The target's distribution [vocab] at the node of each walk that samples, by its index;
    greedy walks need only the argmax. processed: [A, vocab] logits with penalties applied."""
    sampling = [i for i, walk in enumerate(walks) if not walk.params.greedy]
    if not sampling:
        return {}
    probs = target_probabilities(processed[sampling], [walks[i].params for i in sampling])
    return dict(zip(sampling, probs))  # each [vocab]


def _node_logits(
    active: list[_Walk], verified: ForwardOutput, computed: dict[int, torch.Tensor]
) -> torch.Tensor:  # [A, vocab] raw target logits at each active walk's node
    """The lm_head costs about as much for a few rows as for one (reading its weight dominates),
    so when the nodes at or below the active walks' current ones are few, all of their logits are
    computed in the one call the current nodes need; otherwise only the current nodes'."""
    wanted = [walk.root_row + walk.node for walk in active]
    missing = [row for row in wanted if row not in computed]
    if missing:
        below = [walk.root_row + node for walk in active for node in walk.subtree()]
        rows = below if len(below) <= FREE_LOGITS_ROWS else missing
        computed.update(zip(rows, verified.node_logits(rows)))
    return torch.stack([computed[row] for row in wanted])


def _penalised(walks: list[_Walk], logits: torch.Tensor) -> torch.Tensor:
    """Penalties, bias and bans, for the walks whose requests ask for them; each node is
    conditioned on its own path. logits: [A, vocab] raw, at each walk's node."""
    processed = logits
    for i, walk in enumerate(walks):
        params, seq = walk.params, walk.seq
        needs = (
            params.has_penalties or params.logit_bias or seq.num_output_tokens < params.min_tokens
        )
        if needs:
            if processed is logits:
                processed = logits.clone()
            path = [walk.tree.tokens[n] for n in walk.accepted]
            apply_penalties(processed[i : i + 1], [logits_context(seq, path)])
    return processed


def _constrained(walks: list[_Walk], processed: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Mask what each constrained walk's grammar forbids after its own path (the sequence's
    tokens plus the accepted nodes). processed: [A, vocab], never `raw` itself once masked."""
    constrained = [i for i, walk in enumerate(walks) if walk.seq.grammar is not None]
    if not constrained:
        return processed
    if processed is raw:
        processed = raw.clone()
    for i in constrained:
        walk = walks[i]
        path = [walk.tree.tokens[n] for n in walk.accepted]
        mask_logits(processed[i : i + 1], walk.seq.grammar.bitmasks_along([path]))
    return processed


def _emitted_logprobs(walk: _Walk, tokens: list[int]) -> list[TokenLogprob | None]:
    """Raw target logprobs of the emitted tokens: token j comes from the j-th node visited."""
    wanted = walk.params.logprobs
    if wanted is None:
        return [None] * len(tokens)
    logits = torch.stack(walk.raw_logits)  # [len(tokens), vocab]
    chosen, values, ids = token_logprobs(logits, torch.tensor(tokens), wanted)
    return [
        TokenLogprob(t, c, tuple(zip(i, v)))
        for t, c, i, v in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist())
    ]


def _extend_ancestors(
    previous: torch.Tensor | None, expanded: list[int], parents: list[int]
) -> torch.Tensor:
    """The ancestor mask over a sequence's head rows after appending rows for new nodes.

    `expanded` lists the candidate behind each existing row; `parents` the parent candidate of
    each new node (ROOT for layer 1, whose root row lies in the context). A row sees itself and
    its ancestors' rows. Returns [rows + new, rows + new] bool.
    """
    old, new = len(expanded), len(parents)
    mask = torch.zeros(old + new, old + new, dtype=torch.bool)
    if previous is not None:
        mask[:old, :old] = previous
    for r, parent in enumerate(parents):
        if parent != ROOT:
            mask[old + r] |= mask[expanded.index(parent)]
        mask[old + r, old + r] = True
    return mask


def _draft_lm_head(
    lm_head: nn.Module, draft_vocab: torch.Tensor | None, fp16_weights: bool
) -> nn.Module:
    """The target's lm_head for drafting, or its rows for a reduced draft vocabulary: an
    Fp16Linear where asked for and it can run, else the target's lm_head itself or a CpuLinear
    of the rows sharing the target's kernel choice where it can be, as the target's linears do."""
    weight = lm_head.weight.detach()  # [V, hidden]
    if draft_vocab is not None:
        weight = weight[draft_vocab]  # [V_draft, hidden]
    fp16 = fp16_weights and can_use_fp16_linear(weight)
    if draft_vocab is None and not fp16:
        return lm_head
    rows = nn.Linear(lm_head.in_features, len(weight), bias=False, device="meta")
    rows.weight = nn.Parameter(weight, requires_grad=False)
    if fp16:
        return Fp16Linear(rows)
    if not can_use_cpu_linear(rows.weight):
        return rows
    return CpuLinear(rows, getattr(lm_head, "kernels", None))  # the kernels the target's use
