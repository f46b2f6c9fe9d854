"""Grammar-constrained decoding with speculation is lossless: greedy output equals constrained
plain decoding token for token, seeded sampling gives the same tokens, the first three sampled
tokens keep exactly the target's distribution masked by the grammar (chi-square), and no draft the
grammar forbids is ever proposed."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.sampling.grammar import GrammarCompiler, GrammarSpec, unpack_bitmask
from engine.sampling.logits_processing import target_probabilities
from tests.drafting.conftest import SMALL_VOCAB
from tests.drafting.test_lossless_sampling import NUM_SAMPLES, TREE, chi_square_p_value
from tests.drafting.test_speculative_generation import mixed_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["id", "tags", "kind"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"([a-f]{2,5} ){1,6}(yes|no)\."),
    "json object": GrammarSpec("json_object"),
}
FULL_TREES = dict(adaptive_draft_budget=False, block_size=4, num_kv_blocks=1024)


def record_proposals(llm, proposals: list) -> None:
    """Keep every proposed tree with its sequence's grammar state checked on the spot: the
    number of tree nodes whose path from the root the grammar forbids."""
    drafter = llm.engine.drafter
    propose = drafter.propose

    def checked_propose(batch):
        trees = propose(batch)
        for item in batch.scheduled:
            tree = trees.get(item.seq.seq_id)
            if tree is None or item.seq.grammar is None:
                continue
            forbidden = 0
            for node in range(1, len(tree.tokens)):
                path = []
                while node:
                    path.append(tree.tokens[node])
                    node = tree.parents[node]
                matcher, path = item.seq.grammar, path[::-1]
                consumed = matcher.advance(path)
                forbidden += not matcher.allows(path, consumed)
                matcher.rollback(consumed)
            proposals.append((tree.num_draft_tokens, forbidden))
        return trees

    drafter.propose = checked_propose


def generate(target, head, spec, params_kwargs, prompts, proposals=None):
    llm = LLM(str(target), draft=None if head is None else str(head), **FULL_TREES)
    if proposals is not None:
        record_proposals(llm, proposals)
    params = SamplingParams(structured=spec, max_tokens=60, **params_kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("head", ["random_head", "trained_head"])
def test_greedy_equals_constrained_plain_decoding(bigram_target, head, grammar, request):
    head_dir = request.getfixturevalue(head)
    prompts = mixed_prompts(6, seed=1)
    greedy = dict(temperature=0)
    plain, _ = generate(bigram_target, None, GRAMMARS[grammar], greedy, prompts)
    proposals: list = []
    spec, outputs = generate(bigram_target, head_dir, GRAMMARS[grammar], greedy, prompts, proposals)
    assert spec == plain
    assert sum(n for n, _ in proposals) > 0, "trees were drafted"
    assert all(forbidden == 0 for _, forbidden in proposals), "a forbidden draft was proposed"
    if head == "trained_head":
        assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(
    bigram_target, trained_head
):
    prompts = mixed_prompts(6, seed=2)
    settings = dict(temperature=0.8, top_p=0.95, seed=11)
    for spec in GRAMMARS.values():
        plain, _ = generate(bigram_target, None, spec, settings, prompts)
        speculative, _ = generate(bigram_target, trained_head, spec, settings, prompts)
        assert speculative == plain


# On the 8-token vocabulary (3: ' ', 4: '!', 5: '"', 6: '#', 7: '$'): '"' must be followed by
# '#' or '$', ' ' never appears, and the end of sequence is allowed except right after '"'.
SMALL_GRAMMAR = GrammarSpec("regex", r'(!|"[#$])*')
PROMPT = [1, 3, 4, 5, 3]
NUM_TOKENS = 3


def exact_constrained_distribution(target) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) from transformers' logits masked by llguidance at each prefix."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    matcher = GrammarCompiler(tokenizer, SMALL_VOCAB, {2}).compile(SMALL_GRAMMAR).matcher()
    params = SamplingParams(temperature=1.0)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        allowed = unpack_bitmask(matcher.bitmasks_along([list(p) for p in prefixes]), SMALL_VOCAB)
        masked = logits.float().masked_fill(~allowed, float("-inf"))  # [P, vocab]
        step = target_probabilities(masked, [params] * len(prefixes))
        probs = {
            (*p, t): probs[p] * float(step[i, t])
            for i, p in enumerate(prefixes)
            for t in range(SMALL_VOCAB)
            if step[i, t] > 0
        }
    return probs


def test_constrained_speculative_sampling_keeps_the_masked_distribution(small_vocab):
    expected = exact_constrained_distribution(small_vocab["target"])
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-5)
    llm = LLM(
        str(small_vocab["target"]),
        draft=str(small_vocab["trained"]),
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        num_kv_blocks=8192,
        block_size=8,
        **TREE,
    )
    params = [
        SamplingParams(
            max_tokens=NUM_TOKENS + 3, ignore_eos=True, seed=seed, structured=SMALL_GRAMMAR
        )
        for seed in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > NUM_SAMPLES // 2
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        key = tuple(output.outputs[0].token_ids[:NUM_TOKENS])
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p_value(counts, expected) > 0.001


def test_tokens_the_grammar_forces_are_drafted_outside_the_draft_vocabulary(
    bigram_target, random_eagle3_head
):
    """The head's draft vocabulary lacks uppercase letters and '-' (target ids below 64), so only
    the grammar can draft "ABC-ABC-ABC-": each of those tokens is the one it allows, certain to
    be accepted, and drafted whatever the head says."""
    spec = GrammarSpec("regex", r"(ABC-){3}(yes|no)\.")
    prompts = mixed_prompts(4, seed=3)
    greedy = dict(temperature=0)
    plain, _ = generate(bigram_target, None, spec, greedy, prompts)
    speculative, outputs = generate(bigram_target, random_eagle3_head, spec, greedy, prompts)
    assert speculative == plain
    # of the 11 forced tokens after the first 'A' (sampled by the prefill), the steps accept most
    assert all(o.metrics.num_accepted_tokens >= 8 for o in outputs)
