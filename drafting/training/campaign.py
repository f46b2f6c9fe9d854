"""`aerie head-campaign`: train and measure a draft head in rounds of growing data, for as many
sessions as it takes.

Round r trains the previous round's head further on the source conversations up to `rounds[r]`
that no earlier round read (`train-head --first-conversation`), so each conversation costs its
features and epochs once, and measures it on the dev set per category and tree shape. With
`self_distil` (the default) the conversations are first answered by the target (`distill-data`:
by default its greedy answers to first turns, the data the shipped head was trained on) and the
rounds count distilled conversations; `distilled_seed` starts the answers from a committed file.
Without it the head learns the target's next-token distribution on the source's own answers,
which costs no generation but measured far lower. Every stage resumes where it stopped:
distillation after the records already written, feature caching after its last shard, training
from its last checkpoint (every `checkpoint_every` optimizer steps), and a round's measurement is
redone if it was cut short. A measured round's cached features are deleted (a later round never
reads them). The learning curve, one record per finished round, is `OUT/head_training.json`;
`OUT/best-head` is the head of the round that measured best. After the first round the shipped
head is measured once on the same dev set (`OUT/shipped_head.json`), the figure a round's head
must beat.

Self-distilled rounds then go on to later turns (`later_rounds`): the first-turn answers are
continued, each conversation's later user turns answered after the target's own earlier answers
(`distill-data --continue-from`, into `OUT/later_turns.jsonl`, only records that gained a turn;
`later_sampled_share` of them sampled, for sampled traffic), and each such round trains on the
records no earlier one read; `later_seed` starts them from a committed file."""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from drafting.shipped_heads import shipped_head
from drafting.training.data import open_text
from drafting.training.dev_set import read_dev_set
from drafting.training.distill import DistillConfig, distill
from drafting.training.evaluation import DEFAULT_TREE, acceptance_lengths, shape_name
from drafting.training.trainer import TrainConfig, train_head
from engine.errors import AerieError


@dataclass(frozen=True)
class CampaignConfig:
    target: str
    out: Path
    dev_set: Path
    data: str = "sharegpt"  # the source conversations (load_conversations)
    # conversations read by the end of each round (distilled ones with self_distil)
    rounds: tuple[int, ...] = (4505, 7000, 9500, 12000, 14500, 17000)
    self_distil: bool = True  # train on the target's answers (distilled first), not the source's
    distil_turns: int = 1  # user turns the target answers per distilled conversation
    distilled_seed: Path | None = None  # committed answers (distill-data's JSONL) to start from
    # with self_distil, later-turn records read by the end of each round after `rounds`
    later_rounds: tuple[int, ...] = (3000, 6000, 9000, 12000)
    later_turns: int = 4  # user turns answered per conversation in later-turn records
    later_sampled_share: float = 0.25  # of later-turn records answered by sampling
    later_seed: Path | None = None  # committed later-turn records to start from
    max_tokens: int = 160  # per distilled answer
    sampled_share: float = 0.0  # of distilled conversations answered by sampling
    arch: str = "eagle3"
    epochs: int = 6  # each round's conversations
    batch_tokens: int = 1024  # per optimizer step: a round's few new conversations need many steps
    draft_vocab_size: int = 8192
    unroll_steps: int = 3
    prompt_loss: bool = True  # also learn the target's next token inside user turns
    feature_weight: float = 1.0  # and regress to the target's next state (EAGLE-3 too)
    eval_max_tokens: int = 128
    seed: Path | None = None  # a committed copy of the campaign to resume from (docstring)
    train: dict = field(default_factory=dict)  # further TrainConfig fields

    def __post_init__(self) -> None:
        for name in ("rounds", "later_rounds"):
            counts = getattr(self, name)
            if list(counts) != sorted(set(counts)) or (name == "rounds" and not counts):
                raise AerieError(f"{name} must be increasing conversation counts, got {counts}")


@dataclass(frozen=True)
class _Round:
    """What a round trains on: records [start, stop) of its data (the source's conversations,
    the first-turn answers, or with `later` the later-turn records)."""

    start: int
    stop: int
    later: bool = False

    @property
    def name(self) -> str:
        return f"round-later-{self.stop}" if self.later else f"round-{self.stop}"


def _schedule(config: CampaignConfig) -> list[_Round]:
    """Every round of the campaign, in order."""
    first = [_Round(a, b) for a, b in zip((0, *config.rounds), config.rounds)]
    if not config.self_distil:
        return first
    later = zip((0, *config.later_rounds), config.later_rounds)
    return first + [_Round(a, b, later=True) for a, b in later]


def run_campaign(config: CampaignConfig) -> Path:
    """Run every round not yet recorded; return the learning curve's path."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    curve_path = out / "head_training.json"
    curve = json.loads(curve_path.read_text()) if curve_path.exists() else []
    curve = _adopt_seed(config, out, curve)
    dev_set = read_dev_set(config.dev_set)
    schedule = _schedule(config)
    for index, round_ in enumerate(schedule):
        if index < len(curve):
            continue
        previous = out / schedule[index - 1].name / "head" if index else None
        folder = out / round_.name
        data = _round_data(config, out, round_)
        train = _train_config(config, data, folder, range(round_.start, round_.stop), previous)
        head = _trained(train)
        acceptance = acceptance_lengths(
            config.target, head, dev_set, max_tokens=config.eval_max_tokens
        )
        seen = (curve[-1]["training_tokens_seen"] if curve else 0) + _tokens_trained(head.parent)
        curve.append(
            {
                "round": index,
                "conversations": round_.stop,
                "later_turns": round_.later,
                "arch": config.arch,
                "recipe": _recipe(train),
                "training_tokens_seen": seen,
                "acceptance_length": acceptance,
                "head": str(head),
            }
        )
        curve_path.write_text(json.dumps(curve, indent=2) + "\n")
        _drop_features(folder)
        _keep_best(out, curve)
        _measure_shipped(config, out, dev_set)
    return curve_path


def _recipe(train: TrainConfig) -> dict:
    """What a round's record says of its training: a seed must match it to be adopted."""
    return {
        "epochs": train.epochs,
        "batch_tokens": train.batch_tokens,
        "prompt_loss": train.prompt_loss,
        "feature_weight": train.feature_weight,
    }


def _adopt_seed(config: CampaignConfig, out: Path, curve: list[dict]) -> list[dict]:
    """The seed's curve, its last round's head copied into OUT, when the seed is further along
    than OUT and ran this campaign; else `curve` unchanged."""
    if config.seed is None or not Path(config.seed).is_file():
        return curve
    seed = json.loads(Path(config.seed).read_text())
    rounds, head = seed.get("rounds", []), seed.get("last_head")
    if len(rounds) <= len(curve) or head is None:
        return curve
    schedule = _schedule(config)
    expected = _recipe(_train_config(config, Path(config.data), out, range(0), None))
    ran = [(r["conversations"], r.get("later_turns", False)) for r in rounds]
    if ran != [(r.stop, r.later) for r in schedule[: len(ran)]] or any(
        r["arch"] != config.arch or r["recipe"] != expected for r in rounds
    ):
        print(f"seed {config.seed} ran another campaign: not adopted", flush=True)
        return curve
    folder = out / schedule[len(rounds) - 1].name
    shutil.copytree(Path(config.seed).parent / head, folder / "head", dirs_exist_ok=True)
    adopted = [{**r, "head": str(folder / "head") if r is rounds[-1] else None} for r in rounds]
    (out / "head_training.json").write_text(json.dumps(adopted, indent=2) + "\n")
    if seed.get("shipped_head") and not (out / "shipped_head.json").exists():
        (out / "shipped_head.json").write_text(json.dumps(seed["shipped_head"], indent=2))
    print(f"adopted {len(rounds)} rounds from {config.seed}", flush=True)
    return adopted


def _round_data(config: CampaignConfig, out: Path, round_: _Round) -> Path | str:
    """The data a round reads: the source, or answers distilled up to the round's last record."""
    if not config.self_distil:
        return config.data
    first_turns = _distilled(
        config,
        out / "distilled.jsonl",
        config.distilled_seed,
        config.rounds[-1] if round_.later else round_.stop,
        config.distil_turns,
    )
    if not round_.later:
        return first_turns
    return _distilled(
        replace(config, sampled_share=config.later_sampled_share),
        out / "later_turns.jsonl",
        config.later_seed,
        round_.stop,
        config.later_turns,
        first_turns,
    )


def _distilled(
    config: CampaignConfig,
    data: Path,
    seed: Path | None,
    records: int,
    turns: int,
    continue_from: Path | None = None,
) -> Path:
    """`data` holding at least `records` records: the seed's first, in its order, when the file
    is new, so a seeded round reads exactly the records it was trained on. Only turns whose
    prompt and answer fit the training's tokens per conversation are answered: training cuts
    the rest, and their long prompts cost most of the prefill."""
    if seed is not None and not data.exists():
        with open_text(seed) as committed, data.open("w") as copy:
            shutil.copyfileobj(committed, copy)
    distill(
        DistillConfig(
            config.target,
            config.data,
            data,
            max_conversations=records,
            max_context_tokens=config.train.get("max_tokens", TrainConfig.max_tokens),
            max_tokens=config.max_tokens,
            max_turns=turns,
            sampled_share=config.sampled_share,
            continue_from=continue_from,
        )
    )
    return data


def commit_distilled(distilled: Path, committed: Path) -> None:
    """Gzip a campaign's complete answer records over `committed` (its `distilled_seed`) when they
    are more: the campaign starts from the committed ones, so they stay its first records, in the
    same order, and a new machine distils only what no commit holds."""
    if not distilled.exists():
        return
    text = distilled.read_text()
    records = text[: text.rfind("\n") + 1]  # a line cut off by an interruption is not yet one
    if committed.exists():
        with open_text(committed) as lines:
            if records.count("\n") <= sum(1 for _ in lines):
                return
    # mtime 0: the same records give the same bytes, so an unchanged campaign changes no file
    with gzip.GzipFile(committed, "wb", mtime=0) as out:
        out.write(records.encode())


def _train_config(
    config: CampaignConfig, data: Path, folder: Path, conversations: range, previous: Path | None
) -> TrainConfig:
    """The round's training, with `config.train`'s further fields applied."""
    train = TrainConfig(
        config.target,
        str(data),
        folder,
        arch=config.arch,
        first_conversation=conversations.start,
        max_conversations=conversations.stop,
        epochs=config.epochs,
        batch_tokens=config.batch_tokens,
        draft_vocab_size=config.draft_vocab_size,
        unroll_steps=config.unroll_steps,
        prompt_loss=config.prompt_loss,
        feature_weight=config.feature_weight,
        init_head=str(previous) if previous else None,
        resume=(folder / "checkpoint.pt").exists(),
    )
    return replace(train, **config.train)


def _trained(train: TrainConfig) -> Path:
    head = train_head(train)
    if not (head / "config.json").exists():
        raise AerieError(f"training in {train.out} wrote no head")
    return head


def _tokens_trained(folder: Path) -> int:
    """Tokens the round's training read: its cached tokens times the epochs it ran."""
    from safetensors.torch import load_file

    shards = sorted(folder.glob("features*/shard-*.safetensors"))
    tokens = sum(int(load_file(str(s))["token_ids"].numel()) for s in shards)
    epochs = max((json.loads(r).get("epoch", 0) for r in _log_lines(folder)), default=0)
    return tokens * epochs


def _drop_features(folder: Path) -> None:
    """Delete a measured round's cached features (EAGLE-3: four hidden states a token, fp16)."""
    for features in folder.glob("features*"):
        if features.is_symlink():
            features.unlink()
        else:
            shutil.rmtree(features)


def _log_lines(folder: Path) -> list[str]:
    log = folder / "train_log.jsonl"
    return log.read_text().splitlines() if log.exists() else []


def _measure_shipped(config: CampaignConfig, out: Path, dev_set: list[dict]) -> None:
    """The shipped head's dev-set acceptance, once, into OUT/shipped_head.json: what a round's
    head must beat (by 0.05 at the default tree) to replace it."""
    path, shipped = out / "shipped_head.json", shipped_head(config.target)
    if path.exists() or shipped is None:
        return
    acceptance = acceptance_lengths(
        config.target, shipped, dev_set, max_tokens=config.eval_max_tokens
    )
    path.write_text(json.dumps({"head": str(shipped), "acceptance_length": acceptance}, indent=2))


def _keep_best(out: Path, curve: list[dict]) -> None:
    """Copy the head of the round with the best dev-set acceptance (default tree) to best-head
    (of the rounds whose head this machine has: an adopted seed brings only its last)."""
    best = max(
        (r for r in curve if r["head"]),
        key=lambda r: r["acceptance_length"][shape_name(DEFAULT_TREE)]["all"],
    )
    shutil.copytree(best["head"], out / "best-head", dirs_exist_ok=True)
