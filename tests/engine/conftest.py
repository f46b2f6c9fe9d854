"""Fixtures of the engine tests."""

from __future__ import annotations

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
