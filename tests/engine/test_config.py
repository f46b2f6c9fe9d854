"""Engine configuration from keywords, YAML presets and command-line flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.errors import AerieError
from server.engine_args import add_engine_arguments, engine_config_from_args

PRESET = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"


def parse(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")
    parser.add_argument("--draft", default="none")
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(flags)))


def test_the_cpu_preset_loads_and_flags_override_it():
    preset = EngineConfig.from_yaml(PRESET)
    assert (preset.device, preset.dtype, preset.max_num_seqs) == ("cpu", "float32", 32)
    config = parse("--config", str(PRESET), "--max-num-seqs", "8", "--no-enable-prefix-caching")
    assert config.max_num_seqs == 8 and config.dtype == "float32"
    assert config.enable_prefix_caching is False
    assert config.draft is None


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(AerieError, match="unknown engine option"):
        EngineConfig.from_options("m", max_seqs=3)
    with pytest.raises(AerieError, match="draft_total_tokens"):
        EngineConfig(draft_top_k=1, draft_depth=2, draft_total_tokens=8)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not a mapping\n")
    with pytest.raises(AerieError, match="mapping"):
        EngineConfig.from_yaml(bad)
