"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import save_tiny_model


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """These models are tiny: one thread is faster than several, and far faster on a shared
    machine, where torch's threads spin waiting for each other (5 s instead of 12 s for the
    random-traffic test on two busy cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def generation_model(tmp_path_factory) -> Path:
    """A tiny random Llama with large weights (initializer_range 0.3), so that greedy decoding
    wanders over the vocabulary instead of repeating one token, and logit margins are wide."""
    return save_tiny_model(
        tmp_path_factory.mktemp("generation") / "llama", "llama", seed=3, initializer_range=0.3
    )
