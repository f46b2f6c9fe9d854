"""Fixtures for speculative decoding: a predictable tiny target, a random head (acceptance near
zero) and a head trained for seconds on the target's own greedy text (acceptance well above)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.spec.draft_controller import DraftController
from tests.conftest import save_random_eagle3_head, save_random_head, save_tiny_model

SMALL_VOCAB = 8  # tokens in `small_vocab`


class AlwaysDraft(DraftController):
    """The controller's choice fixed to drafting, to watch the parts after it."""

    def choose(self, num_decoding: int) -> bool:
        return True


class AlternateDrafting(DraftController):
    """Drafting and plain steps in turn, whatever they measure: both kinds in every run."""

    def __init__(self) -> None:
        super().__init__()
        self.num_choices = 0

    def choose(self, num_decoding: int) -> bool:
        self.num_choices += 1
        return self.num_choices % 2 == 1


def train_head_quickly(
    target_dir: Path, head_dir: Path, out_dir: Path, steps: int = 150, seed: int = 0
) -> Path:
    """Fine-tune the head in `head_dir` on greedy continuations of random prompts."""
    from drafting.head_loader import load_head, save_head
    from drafting.training.features import target_features
    from drafting.training.objective import TrainingExample, head_losses
    from engine import LLM, SamplingParams

    rng = random.Random(seed)
    torch.manual_seed(seed)
    llm = LLM(str(target_dir), draft=None, num_kv_blocks=512, block_size=8)
    vocab = llm.engine.spec.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12))] for _ in range(64)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    target = llm.engine.runner.model.requires_grad_(False)
    head = load_head(head_dir, llm.engine.spec, 512, torch.device("cpu"), torch.float32).train()
    target.feature_layers = head.feature_layers  # EAGLE-3 heads read three layers' states
    examples = [
        TrainingExample(torch.tensor(s), f, torch.ones(len(s), dtype=torch.bool))
        for s, f in zip(sequences, target_features(target, sequences))
    ]
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = head_losses(head, target, rng.sample(examples, 16))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_head(head, out_dir, {"rope_theta": 10000.0}, torch.float32)


@pytest.fixture(scope="session")
def bigram_target(tmp_path_factory) -> Path:
    """A tiny Llama whose layers add little to the residual stream: nearly a bigram model."""
    root = tmp_path_factory.mktemp("bigram-target")
    return save_tiny_model(
        root / "llama",
        "llama",
        residual_scale=0.1,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


@pytest.fixture(scope="session")
def random_head(bigram_target, tmp_path_factory) -> Path:
    return save_random_head(tmp_path_factory.mktemp("random-head"), bigram_target)


@pytest.fixture(scope="session")
def trained_head(bigram_target, random_head, tmp_path_factory) -> Path:
    return train_head_quickly(bigram_target, random_head, tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="session")
def random_eagle3_head(bigram_target, tmp_path_factory) -> Path:
    """A random EAGLE-3 head whose draft vocabulary is 3/4 of the target's."""
    folder = tmp_path_factory.mktemp("random-eagle3-head")
    return save_random_eagle3_head(folder, bigram_target, draft_vocab_size=192)


@pytest.fixture(scope="session")
def trained_eagle3_head(bigram_target, random_eagle3_head, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained-eagle3")
    return train_head_quickly(bigram_target, random_eagle3_head, folder)


@pytest.fixture(scope="session")
def random_two_layer_eagle3_head(bigram_target, tmp_path_factory) -> Path:
    """A random EAGLE-3 head of two decoder layers (vLLM's num_hidden_layers = 2)."""
    folder = tmp_path_factory.mktemp("random-eagle3-2-layers")
    return save_random_eagle3_head(folder, bigram_target, draft_vocab_size=192, num_layers=2)


@pytest.fixture(scope="session")
def trained_two_layer_eagle3_head(bigram_target, random_two_layer_eagle3_head, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained-eagle3-2-layers")
    return train_head_quickly(bigram_target, random_two_layer_eagle3_head, folder)


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory) -> dict[str, Path]:
    """A tiny model with an 8-token vocabulary, sharp enough for sampled drafts to be accepted,
    with a random head, one trained for seconds, and an EAGLE-3 head trained for seconds."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = save_tiny_model(
        root / "target",
        "llama",
        vocab_size=SMALL_VOCAB,
        initializer_range=0.3,
        tie_word_embeddings=False,
        residual_scale=0.5,
    )
    random_head = save_random_head(root / "random-head", target)
    trained = train_head_quickly(target, random_head, root / "trained-head", steps=100)
    # EAGLE-3: a draft vocabulary of 6 of the 8 tokens, so some target tokens are never drafted
    random_eagle3 = save_random_eagle3_head(root / "random-eagle3", target, draft_vocab_size=6)
    eagle3 = train_head_quickly(target, random_eagle3, root / "trained-eagle3", steps=100)
    return {"target": target, "random": random_head, "trained": trained, "eagle3": eagle3}
