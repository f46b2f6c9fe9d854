"""`aerie bench serve`: the load generator's figures against a live server, and their arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.errors import AerieError
from server.serving_benchmark import (
    BenchConfig,
    RequestRecord,
    bootstrap_interval,
    load_prompts,
    output_length,
    ratios_to_reference,
    run_benchmark,
    summarize,
)
from tests.server.conftest import API_KEY

pytestmark = pytest.mark.timeout(300)


def test_summary_follows_the_vllm_definitions():
    records = [
        RequestRecord(ok=True, output_tokens=5, ttft=0.1, e2e=0.5, itls=[0.1, 0.1, 0.2]),
        RequestRecord(ok=True, output_tokens=3, ttft=0.2, e2e=0.4, itls=[0.2]),
        RequestRecord(ok=False, error="HTTP 503"),
    ]
    summary = summarize(records, concurrency=2, elapsed=2.0)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == pytest.approx(8 / 2.0)
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["mean_tpot_ms"] == pytest.approx(1000 * (0.4 / 4 + 0.2 / 2) / 2)
    itls = [0.1, 0.1, 0.2, 0.2]
    assert summary["p99_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 99))
    assert summary["p50_e2e_ms"] == pytest.approx(1000 * np.percentile([0.5, 0.4], 50))
    assert summary["errors"] == ["HTTP 503"]


def test_ratios_pair_each_trial_with_the_reference_s_same_trial():
    def level(*trials):  # (tokens/s, median TPOT ms) per trial
        runs = [{"output_throughput": t, "p50_tpot_ms": m} for t, m in trials]
        return {"concurrency": 4, "trials": runs}

    runs = {
        # the machine ran twice as fast in trial 2: its ratio is trial 1's, 0.9, where pooling
        # tokens and seconds over trials would weigh trial 2 double
        "aerie-ar": {"levels": [level((100, 10), (200, 5), (100, 10))]},
        "aerie-spec": {"levels": [level((90, 11), (180, 5.5), (120, 8))]},
        "other-level-only": {"levels": [{**level((50, 1)), "concurrency": 8}]},
    }
    ratios = ratios_to_reference(runs, "aerie-ar")
    spec = ratios["aerie-spec"]["4"]
    assert spec["throughput_trials"] == pytest.approx([0.9, 0.9, 1.2])
    assert spec["throughput"] == pytest.approx((0.9 * 0.9 * 1.2) ** (1 / 3))
    assert spec["tpot"] == pytest.approx((1.1 * 1.1 * 0.8) ** (1 / 3))
    low, high = spec["throughput_ci95"]
    assert 0.9 <= low < spec["throughput"] < high <= 1.2
    assert ratios["other-level-only"] == {}
    assert ratios_to_reference(runs, reference="absent") == {}


def test_the_interval_narrows_as_trials_agree():
    spread = bootstrap_interval([0.9, 1.1] * 4)
    close = bootstrap_interval([0.99, 1.01] * 4)
    assert spread[0] < close[0] < 1.0 < close[1] < spread[1]
    assert bootstrap_interval([1.03] * 5) == pytest.approx([1.03, 1.03])
    assert bootstrap_interval([0.98, 1.02] * 4) == bootstrap_interval([0.98, 1.02] * 4)


def test_the_interval_widens_with_the_rounds_spread():
    """Two rounds whose processes ran at their own speeds (trials 1.04 and 1.00, say): eight
    trials taken as independent give a narrow interval about 1.02; resampled by round, it
    reaches each round's own figure."""
    ratios = [1.04, 1.05, 1.03, 1.04, 1.00, 0.99, 1.01, 1.00]
    rounds = [0, 0, 0, 0, 1, 1, 1, 1]
    independent = bootstrap_interval(ratios)
    by_round = bootstrap_interval(ratios, rounds)
    assert independent[0] > 1.0
    assert by_round[0] < 1.005 and by_round[1] > 1.035


def test_prompt_files_in_three_shapes(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"turns": ["first turn", "second turn"]},
        {"prompt": "plain"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_prompts(path) == [
        [{"role": "user", "content": "first turn"}],
        [{"role": "user", "content": "plain"}],
        lines[2]["messages"],
    ]


def test_prompts_of_one_category(tmp_path):
    path = tmp_path / "dev_set.jsonl"
    lines = [
        {"category": "code", "prompt": "Write a sort."},
        {"category": "writing", "prompt": "Write a poem."},
        {"category": "code", "prompt": "Fix this loop."},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_prompts(path, "code") == [
        [{"role": "user", "content": "Write a sort."}],
        [{"role": "user", "content": "Fix this loop."}],
    ]
    with pytest.raises(AerieError, match="no prompts of category 'math'"):
        load_prompts(path, "math")


def test_a_sweep_against_a_live_server(tiny_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}"}) + "\n" for w in "abc"))
    out = tmp_path / "results" / "serve.json"
    command = [
        sys.executable,
        "-c",
        "from server.cli import main; main()",
        "bench",
        "serve",
        "--base-url",
        tiny_server.base_url,
        "--api-key",
        API_KEY,
        "--prompts",
        str(prompts),
        "--concurrency",
        "1,4",
        "--num-prompts",
        "8",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--range-ratio",
        "0.5",
        "--label",
        "tiny",
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=240)
    data = json.loads(out.read_text())
    run = data["runs"]["tiny"]
    assert run["model"] == tiny_server.model
    assert [level["concurrency"] for level in run["levels"]] == [1, 4]
    for level in run["levels"]:
        assert level["completed"] == 8 and level["failed"] == 0, level.get("errors")
        assert level["output_tokens"] == sum(output_length(12, 0.5, i) for i in range(8))
        assert 0 < level["mean_ttft_ms"] < level["mean_e2e_ms"]
        assert level["p50_itl_ms"] <= level["p99_itl_ms"]
        assert level["output_throughput"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_slice_sends_its_own_requests(tiny_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count to ten"}) + "\n")
    config = BenchConfig(
        tiny_server.base_url,
        prompts,
        concurrency=(2,),
        max_tokens=12,
        num_prompts=4,
        ignore_eos=True,
        range_ratio=0.5,
        first_request=8,
        api_key=API_KEY,
    )
    (level,) = run_benchmark(config)["levels"]
    assert level["output_tokens"] == sum(output_length(12, 0.5, i) for i in range(8, 12))


def test_output_lengths_spread_alike_for_every_server():
    lengths = [output_length(128, 0.5, i) for i in range(200)]
    assert lengths == [output_length(128, 0.5, i) for i in range(200)]  # seeded by index
    assert min(lengths) >= 64 and max(lengths) <= 192
    assert min(lengths) < 80 and max(lengths) > 176  # spread over the range, not bunched
    assert {output_length(128, 0.0, i) for i in range(20)} == {128}
    with pytest.raises(AerieError, match="range_ratio"):
        BenchConfig(base_url="http://x", prompts=Path("p.jsonl"), range_ratio=1.0)
