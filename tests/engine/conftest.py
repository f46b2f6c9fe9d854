"""Fixtures of the engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import save_tiny_model


@pytest.fixture(scope="session")
def generation_model(tmp_path_factory) -> Path:
    """A tiny random Llama with large weights (initializer_range 0.3), so that greedy decoding
    wanders over the vocabulary instead of repeating one token, and logit margins are wide."""
    return save_tiny_model(
        tmp_path_factory.mktemp("generation") / "llama", "llama", seed=3, initializer_range=0.3
    )


@pytest.fixture(scope="session")
def model_paths(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The four tiny families, plus Mistral with a sliding window shorter than the sequence
    (keyed as helpers.FAMILIES)."""
    sliding = save_tiny_model(tmp_path_factory.mktemp("mistral-sliding") / "m", "mistral", seed=1)
    config = json.loads((sliding / "config.json").read_text())
    (sliding / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
    return {**tiny_models, "mistral-sliding-window": sliding}
