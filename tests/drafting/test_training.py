"""Head training: conversation data, loss masks, the two stages, checkpoints and resume."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from drafting.data import load_conversations, tokenize_conversation
from drafting.trainer import TrainConfig, train_head
from engine import LLM, SamplingParams
from engine.errors import AerieError
from engine.model_files import load_tokenizer


def write_jsonl(path, count: int, seed: int = 0):
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            words = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(6))
            out.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": words},
                            {
                                "role": "assistant",
                                "content": [{"type": "text", "text": words.upper()}],
                            },
                        ]
                    }
                )
                + "\n"
            )
    return path


def test_sharegpt_is_read_until_its_truncated_end():
    conversations = list(itertools.islice(load_conversations("sharegpt"), 50))
    assert len(conversations) == 50
    for messages in conversations:
        assert messages[0]["role"] in ("user", "system")
        assert any(m["role"] == "assistant" for m in messages)
        assert {m["role"] for m in messages} <= {"system", "user", "assistant"}


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_models, tmp_path):
    tokenizer = load_tokenizer(tiny_models["llama"])
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "HELLO"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "WORLD"},
    ]
    tokenized = tokenize_conversation(tokenizer, messages, max_tokens=512)
    kept = tokenizer.decode([t for t, m in zip(tokenized.token_ids, tokenized.loss_mask) if m])
    assert "HELLO" in kept and "WORLD" in kept
    assert "hi there" not in kept and "again" not in kept
    cut = tokenize_conversation(tokenizer, messages, max_tokens=31)
    assert len(cut.token_ids) == len(cut.loss_mask) == 31
    assert tokenize_conversation(tokenizer, messages, max_tokens=5) is None  # no assistant token


def test_bad_data_source_is_a_clear_error(tmp_path):
    with pytest.raises(AerieError, match="jsonl"):
        list(load_conversations(str(tmp_path / "missing.jsonl")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"no_messages": 1}\n')
    with pytest.raises(AerieError, match=r"broken\.jsonl:1"):
        list(load_conversations(str(broken)))


def test_train_head_end_to_end_and_resume(bigram_target, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", 60)
    config = TrainConfig(
        target=str(bigram_target),
        data=str(data),
        out=tmp_path / "run",
        epochs=1,
        batch_tokens=512,
        shard_tokens=1500,
        checkpoint_every=3,
        warmup_steps=2,
        eval_conversations=2,
        eval_max_tokens=8,
    )
    head = train_head(config)
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    shards = sorted((tmp_path / "run" / "features").glob("shard-*.safetensors"))
    assert len(shards) > 1
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    steps = [r["step"] for r in log if "step" in r]
    assert [r["epoch"] for r in log if "acceptance_length" in r] == [1]
    # the published format loads in the engine, which then decodes exactly as without it
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(bigram_target), draft=None).generate([[5, 6, 7]], params, use_tqdm=False)
    drafted = LLM(str(bigram_target), draft=str(head)).generate([[5, 6, 7]], params, use_tqdm=False)
    assert plain[0].outputs[0].token_ids == drafted[0].outputs[0].token_ids
    # resuming for a second epoch continues from the checkpoint's step, reusing the features
    train_head(TrainConfig(**{**config.__dict__, "epochs": 2, "resume": True}))
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    more = [r["step"] for r in log if "step" in r][len(steps) :]
    assert more[0] == steps[-1] + 1
    assert sorted((tmp_path / "run" / "features").glob("shard-*.safetensors")) == shards
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["state"]["epoch"] == 2
