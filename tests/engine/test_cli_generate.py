"""`aerie generate` (server/cli.py) prints the completion LLM.generate gives, with and without a
draft head."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.stats import StepStats
from server import cli
from tests.conftest import save_random_head
from tests.engine.helpers import tiny_llm

PROMPT = "Say something"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def expected(generation_model) -> str:
    """The greedy completion of PROMPT in the chat template, from the Python facade."""
    llm = tiny_llm(generation_model)
    prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0, max_tokens=12)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(set(output.outputs[0].text)) > 3  # a text that tells completions apart
    return output.outputs[0].text


@pytest.mark.parametrize("draft", ["none", "random-head"])
def test_generate_prints_the_greedy_completion(
    draft, generation_model, expected, tmp_path, capsys, monkeypatch
) -> None:
    model, flags = generation_model, ENGINE_FLAGS
    if draft == "random-head":
        # A head that is almost never right; every tree verified, so speculation really runs.
        draft = str(save_random_head(tmp_path / "head", model))
        flags = [*ENGINE_FLAGS, "--no-adaptive-draft-budget"]
    steps = record_steps(monkeypatch)
    cli.main(
        ["generate", PROMPT, "--model", str(model), "--draft", draft, "--max-tokens", "12", *flags]
    )
    assert capsys.readouterr().out == expected + "\n"
    drafted = sum(s.num_draft_tokens for s in steps)
    assert drafted > 0 if draft != "none" else drafted == 0


def record_steps(monkeypatch) -> list[StepStats]:
    """The StepStats of every engine built from now on (the CLI builds its own)."""
    steps: list[StepStats] = []
    init = LLMEngine.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.stats_listeners.append(steps.append)

    monkeypatch.setattr(LLMEngine, "__init__", recording)
    return steps
