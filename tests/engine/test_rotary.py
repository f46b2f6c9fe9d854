"""Rotary embeddings keep the config's scaling: layers/rotary.py reads transformers 5's
`rope_parameters`, so the project must not admit a transformers that stores it elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from engine.execution.layers.rotary import rope_inverse_frequencies
from tests.conftest import tiny_config

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_declared_transformers_stores_rope_scaling_where_rotary_reads_it() -> None:
    """transformers 4.x keeps a scaling in `rope_scaling`, where rotary.py would not see it and
    would silently use unscaled (default) frequencies for Llama 3, yarn and linear scaling."""
    (line,) = re.findall(r'^\s*"(transformers[^"]*)"', PYPROJECT.read_text(), re.MULTILINE)
    transformers_req = Requirement(line)
    assert not transformers_req.specifier.contains(Version("4.57.1"))
    assert transformers_req.specifier.contains(Version(transformers.__version__))


def test_llama3_scaling_reaches_the_frequencies() -> None:
    config = tiny_config("llama")  # llama3 scaling, factor 8 (tests/conftest.py)
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq, scaling = rope_inverse_frequencies(config, head_dim)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(inv_freq, theirs.float())
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    default = (1.0 / (config.rope_parameters["rope_theta"] ** exponents)).float()
    assert not torch.allclose(inv_freq, default)  # the low frequencies were divided by 8
    assert scaling == 1.0
