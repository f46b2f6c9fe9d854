"""`aerie train-head`: train an EAGLE-1/2 or EAGLE-3 head (`--arch`) for a target, on CPU or CUDA.

Stage 1 runs the target once over the training conversations and caches its features (fp16,
sharded on disk, read back memory-mapped), so the epochs of stage 2 never rerun the target.
Stage 2 trains the head with the EAGLE recipe (objective.py), checkpointing as it goes (`--resume`
continues), and after each epoch writes the head in its published format and measures its
acceptance length with the real engine on held-out conversations. `OUT/head` is the epoch that
measured best (a small head overfits a small corpus, so the last epoch is not always the best);
`OUT/last-head` the latest.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from drafting.eagle3_head import (
    Eagle3Head,
    Eagle3Spec,
    deepened,
    default_feature_layers,
    feature_layers_fit,
)
from drafting.head import EagleHead, HeadSpec
from drafting.head_format import rope_fields
from drafting.head_loader import DraftHead, load_head, save_head
from drafting.training.data import is_held_out, load_conversations, training_conversations
from drafting.training.features import target_features
from drafting.training.objective import TrainingExample, head_losses
from engine.errors import AerieError
from engine.execution.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams

ARCHITECTURES = ("eagle2", "eagle3")


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str
    out: Path
    arch: str = "eagle2"  # "eagle3": three layers' features, its own lm_head, token loss only
    max_conversations: int | None = None  # read up to this one (exclusive)
    first_conversation: int = 0  # and from this one: a campaign round reads only its new ones
    max_tokens: int = 1024  # per conversation
    epochs: int = 4
    batch_tokens: int = 4096  # tokens per optimizer step
    lr: float = 1e-3
    warmup_steps: int = 50
    grad_clip: float = 0.5
    noise: float = 0.2
    checkpoint_every: int = 50  # optimizer steps
    shard_tokens: int = 65536
    eval_conversations: int = 16
    eval_max_tokens: int = 64
    draft_vocab_size: int = 0  # > 0: the head proposes only the most frequent assistant tokens
    unroll_steps: int = 1  # > 1: also train on the head's own predictions (drafting depths 2..)
    intermediate_size: int = 0  # the head's MLP width; 0: the target's
    # EAGLE-3: decoder layers (vLLM's num_hidden_layers) of a new head (None: 1), or of
    # --init-head's deepened by layers that start as the identity (None: its own)
    head_layers: int | None = None
    # EAGLE-3: a new head's residual stream starts from its normed feature (the format's
    # norm_before_residual), not from fc's raw projection
    norm_before_residual: bool = False
    # the regression to the target's next state (EAGLE-3: of the head's normed output); None: the
    # format's own (objective.default_feature_weight)
    feature_weight: float | None = None
    # also learn the target's next token inside user and system turns: their features are cached
    # and the head runs over them anyway, so these labels cost only their share of the loss
    prompt_loss: bool = False
    # EAGLE-3: keep the head's norm and lm_head the target's (as EAGLE-1/2 heads read the target's
    # own): fewer weights to learn from the same data, and no lm_head gradient to compute
    freeze_lm_head: bool = False
    # EAGLE-3: the target layers whose input residual streams the head reads; (): vLLM's default
    # for the target (training_feature_layers). Published in the head's config for other engines
    feature_layers: tuple[int, ...] = ()
    init_head: str | None = None  # start from this head's weights (and its draft vocabulary)
    resume: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise AerieError(f"--arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch}")
        if self.arch == "eagle2" and self.draft_vocab_size:
            raise AerieError(
                "a reduced draft vocabulary is published only in the EAGLE-3 format, which other "
                "engines read: use --arch eagle3 with --draft-vocab-size"
            )
        if self.feature_weight is not None and self.feature_weight < 0:
            raise AerieError(f"--feature-weight must not be negative: {self.feature_weight}")
        if self.freeze_lm_head and self.arch != "eagle3":
            raise AerieError("--freeze-lm-head is for --arch eagle3 (EAGLE-2 reads the target's)")
        if self.feature_layers and (self.arch != "eagle3" or self.init_head):
            raise AerieError(
                "--feature-layers shapes a new EAGLE-3 head (--arch eagle3, no --init-head)"
            )
        if self.intermediate_size < 0:
            raise AerieError(f"--intermediate-size must not be negative: {self.intermediate_size}")
        if self.intermediate_size and self.init_head:
            raise AerieError("--intermediate-size shapes a new head, not one from --init-head")
        if self.head_layers is not None and self.head_layers < 1:
            raise AerieError(f"--head-layers must be at least 1, got {self.head_layers}")
        if self.norm_before_residual and (self.arch != "eagle3" or self.init_head):
            raise AerieError(
                "--norm-before-residual shapes a new EAGLE-3 head (--arch eagle3, no --init-head)"
            )
        if (self.head_layers or 1) > 1 and self.arch != "eagle3":
            raise AerieError("--head-layers is for --arch eagle3 (EAGLE-1/2 heads have one layer)")
        if self.unroll_steps < 1:
            raise AerieError(f"--unroll-steps must be at least 1, got {self.unroll_steps}")
        if self.first_conversation < 0 or (
            self.max_conversations and self.first_conversation >= self.max_conversations
        ):
            raise AerieError(
                f"--first-conversation {self.first_conversation} leaves no conversation "
                f"before --max-conversations {self.max_conversations}"
            )


class HeadTrainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)
        self.llm = LLM(config.target, draft=None, num_kv_blocks=64)
        self.target = self.llm.engine.runner.model.requires_grad_(False)
        self.hf_config = self.llm.engine.hf_config
        # the head to train further, loaded once: its feature layers decide stage 1's features
        self.initial_head = self._initial_head(config.init_head) if config.init_head else None
        if config.arch == "eagle3":  # the target's features: three layers' states
            self.target.feature_layers = self._feature_layers()

    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads: those of the head being continued, those
        asked for, or vLLM's default."""
        if self.initial_head is not None:
            return self.initial_head.feature_layers
        num_layers = self.llm.engine.spec.num_layers
        layers = self.config.feature_layers or self._default_feature_layers()
        if not feature_layers_fit(layers, num_layers):
            raise AerieError(
                f"--feature-layers {list(layers)} outside the target's {num_layers} layers"
            )
        return tuple(layers)

    # ------------------------------------------------------------------ stage 1
    def cache_features(self) -> list[Path]:
        """Shards of (token ids, loss mask, fp16 features); existing shards are kept."""
        folder = self.out / ("features" if self.config.arch == "eagle2" else "features-eagle3")
        folder.mkdir(exist_ok=True)
        self._check_cached_layers(folder)
        done = sorted(folder.glob("shard-*.safetensors"))
        if (folder / "complete").exists():
            return done
        conversations = self._training_conversations()
        pending: list = []
        shard_index, skip_tokens = len(done), self._tokens_in(done)
        seen_tokens = 0
        bar = tqdm(desc="stage 1: target features", unit="tok", unit_scale=True)
        for conversation in conversations:
            seen_tokens += len(conversation.token_ids)
            if seen_tokens <= skip_tokens:
                continue  # already in a shard from an earlier run
            pending.append(conversation)
            if sum(len(c.token_ids) for c in pending) >= self.config.shard_tokens:
                self._write_shard(folder, shard_index, pending, bar)
                shard_index, pending = shard_index + 1, []
        if pending:
            self._write_shard(folder, shard_index, pending, bar)
        bar.close()
        (folder / "complete").write_text("")
        return sorted(folder.glob("shard-*.safetensors"))

    def _default_feature_layers(self) -> tuple[int, ...]:
        """The layers a head of this run's format reads unless told: none for EAGLE-2."""
        if self.config.arch != "eagle3":
            return ()
        return training_feature_layers(self.llm.engine.spec.num_layers)

    def _check_cached_layers(self, folder: Path) -> None:
        """Cached features are of the layers they were computed from: refuse to train on others'.
        A cache from before this record holds the layers every run read then: the defaults."""
        record = folder / "feature_layers.json"
        layers = list(self.target.feature_layers)
        if record.exists():
            cached = json.loads(record.read_text())
        elif any(folder.iterdir()):
            cached = list(self._default_feature_layers())
        else:
            record.write_text(json.dumps(layers))
            return
        if cached != layers:
            raise AerieError(
                f"{folder} holds features of layers {cached}, not {layers}: use another --out"
            )

    def _training_conversations(self):
        config = self.config
        return training_conversations(
            config.data,
            self.llm.get_tokenizer(),
            config.first_conversation,
            config.max_conversations or None,
            config.max_tokens,
        )

    def held_out_prompts(self) -> list[list[int]]:
        """First user turns (after any system message) of held-out conversations, through the
        chat template."""
        prompts = []
        for index, messages in enumerate(load_conversations(self.config.data)):
            first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
            if is_held_out(index) and first_user is not None:
                prompts.append(self.llm.apply_chat_template(messages[: first_user + 1]))
            if len(prompts) == self.config.eval_conversations:
                break
        return prompts

    @staticmethod
    def _tokens_in(shards: list[Path]) -> int:
        return sum(int(load_file(str(s))["token_ids"].numel()) for s in shards)

    def _write_shard(self, folder: Path, index: int, conversations: list, bar) -> None:
        started = time.perf_counter()
        sequences = [c.token_ids for c in conversations]
        features = []
        for chunk in _length_batches(sequences, 4096):
            features += target_features(self.target, chunk)
        tensors = {
            "token_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
            "loss_mask": torch.tensor([m for c in conversations for m in c.loss_mask]),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
        }
        path = folder / f"shard-{index:05d}.safetensors"
        # features beside, as .npy: training maps them from disk instead of holding every shard
        with path.with_suffix(".tmp.npy").open("wb") as file:
            np.save(file, torch.cat(features).half().numpy())
        os.replace(path.with_suffix(".tmp.npy"), path.with_suffix(".npy"))
        save_file(tensors, str(path.with_suffix(".tmp")))
        os.replace(path.with_suffix(".tmp"), path)
        tokens = int(tensors["token_ids"].numel())
        bar.update(tokens)
        bar.set_postfix(shard=index, tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}")

    # ------------------------------------------------------------------ stage 2
    def train(self, shards: list[Path]) -> Path:
        examples = [e for shard in shards for e in _read_shard(shard)]
        head = self.initial_head  # or a new one, its draft vocabulary the answers' tokens
        if head is None:
            head = self._new_head(examples)
        if self.config.prompt_loss:
            examples = [replace(e, loss_mask=torch.ones_like(e.loss_mask)) for e in examples]
        if self.config.freeze_lm_head:
            head.norm.requires_grad_(False)
            head.lm_head.requires_grad_(False)
        trained = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=self.config.lr, weight_decay=0.0)
        steps_per_epoch = max(
            1, sum(len(e.token_ids) for e in examples) // self.config.batch_tokens
        )
        total_steps = steps_per_epoch * self.config.epochs
        state = self._resume(head, optimizer)
        prompts = self.held_out_prompts()
        for epoch in range(state["epoch"], self.config.epochs):
            batches = _token_batches(
                examples, self.config.batch_tokens, random.Random(self.config.seed + epoch)
            )
            bar = tqdm(
                batches,
                desc=f"stage 2: epoch {epoch + 1}/{self.config.epochs}",
                initial=state["batch"],
                total=len(batches),
            )
            for index in range(state["batch"], len(batches)):
                self._step(head, optimizer, batches[index], state, total_steps, bar)
                state["batch"] = index + 1
                if state["step"] % self.config.checkpoint_every == 0:
                    self._checkpoint(head, optimizer, state)
            bar.close()
            state.update(epoch=epoch + 1, batch=0)
            length = self._evaluate(head, prompts, epoch + 1)
            best = state.get("best_acceptance_length", 0.0)
            if length > best or not (self.out / "head").exists():
                shutil.copytree(self.out / "last-head", self.out / "head", dirs_exist_ok=True)
                state["best_acceptance_length"] = length
            self._checkpoint(head, optimizer, state)
        return self.out / "head"

    def _step(self, head, optimizer, batch, state, total_steps, bar) -> None:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(self.config, state["step"], total_steps)
        loss, parts = head_losses(
            head,
            self.target,
            batch,
            self.config.noise,
            self.config.unroll_steps,
            self.config.feature_weight,
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), self.config.grad_clip)
        optimizer.step()
        state["step"] += 1
        tokens = sum(len(e.token_ids) for e in batch)
        bar.update(1)
        bar.set_postfix(
            feature=f"{parts.feature:.3f}",
            token=f"{parts.token:.2f}",
            acc="/".join(f"{a:.2f}" for a in parts.accuracy),
            tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}",
        )
        self._log({"step": state["step"], **asdict(parts)})

    def _new_head(self, examples: list[TrainingExample]) -> DraftHead:
        inv_freq, scaling = rope_inverse_frequencies(self.hf_config, self.llm.engine.spec.head_dim)
        rotary = RotaryEmbedding(inv_freq, scaling, self.llm.engine.max_model_len)
        device = self.target.lm_head.weight.device
        size = self.config.draft_vocab_size
        vocab = self.llm.engine.spec.vocab_size
        answers = torch.cat([e.token_ids[e.loss_mask] for e in examples])  # what drafts propose
        draft_vocab = frequent_tokens(answers, size, vocab) if size else None
        if self.config.arch == "eagle3":
            return self._new_eagle3_head(rotary, draft_vocab).to(device).train()
        head = EagleHead(self._widened(HeadSpec.for_target(self.llm.engine.spec)), rotary)
        head.draft_vocab = draft_vocab
        return head.to(device).train()

    def _new_eagle3_head(self, rotary, draft_vocab: torch.Tensor | None) -> Eagle3Head:
        spec = self.llm.engine.spec
        vocab = draft_vocab if draft_vocab is not None else torch.arange(spec.vocab_size)
        head_spec = replace(
            Eagle3Spec.for_target(
                spec, len(vocab), self.target.feature_layers, self.config.head_layers or 1
            ),
            norm_before_residual=self.config.norm_before_residual,
        )
        head = Eagle3Head(self._widened(head_spec), rotary)
        with torch.no_grad():  # start from the target's lm_head rows of the draft vocabulary
            head.lm_head.weight.copy_(self.target.lm_head.weight[vocab])
            head.norm.weight.copy_(self.target.norm.weight)
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
        return head

    def _widened(self, spec):
        """`spec` (a HeadSpec or Eagle3Spec) with the configured MLP width, if any."""
        if not self.config.intermediate_size:
            return spec
        return replace(spec, intermediate_size=self.config.intermediate_size)

    def _initial_head(self, path: str) -> DraftHead:
        """A trainable copy of the head in `path`, checked against the target like any head."""
        head = load_head(
            path,
            self.llm.engine.spec,
            self.llm.engine.max_model_len,
            self.target.lm_head.weight.device,
            self.target.lm_head.weight.dtype,
        )
        layers = self.config.head_layers
        if layers is None or layers == head.num_layers:
            return head.train()
        if not isinstance(head, Eagle3Head) or layers < head.num_layers:
            raise AerieError(
                f"--head-layers {layers} cannot deepen {path}: an EAGLE-3 head of "
                f"{head.num_layers} layer(s) only gains layers"
            )
        return deepened(head, layers).train()

    def _resume(self, head, optimizer) -> dict:
        path = self.out / "checkpoint.pt"
        if self.config.resume and path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=False)
            head.load_state_dict(saved["head"])
            optimizer.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"])
            return saved["state"]
        return {"epoch": 0, "batch": 0, "step": 0}

    def _checkpoint(self, head, optimizer, state) -> None:
        path = self.out / "checkpoint.pt"
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "state": dict(state),
            },
            path.with_suffix(".tmp"),
        )
        os.replace(path.with_suffix(".tmp"), path)

    def _evaluate(self, head: DraftHead, prompts: list[list[int]], epoch: int) -> float:
        """Save the head to OUT/last-head, and measure its acceptance length with the real
        engine on held-out prompts."""
        rope = rope_fields(self.hf_config)
        folder = save_head(head, self.out / "last-head", rope, torch.float16)
        # whole trees every step: the head's acceptance, not what a draft budget chose to verify
        llm = LLM(
            self.config.target, draft=str(folder), num_kv_blocks=256, adaptive_draft_budget=False
        )
        params = SamplingParams(temperature=0, max_tokens=self.config.eval_max_tokens)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        steps = sum(o.metrics.num_decode_steps for o in outputs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
        length = (steps + accepted) / max(steps, 1)
        print(
            f"epoch {epoch}: mean acceptance length {length:.2f} on {len(prompts)} held-out prompts"
        )
        self._log({"epoch": epoch, "acceptance_length": length})
        return length

    def _log(self, record: dict) -> None:
        with (self.out / "train_log.jsonl").open("a") as log:
            log.write(json.dumps(record) + "\n")


def training_feature_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 layers where the target has enough of them; else low, middle, last."""
    layers = default_feature_layers(num_layers)
    if feature_layers_fit(layers, num_layers):
        return layers
    return (0, num_layers // 2, num_layers - 1)


def frequent_tokens(tokens: torch.Tensor, count: int, vocab_size: int) -> torch.Tensor:
    """The `count` ids seen most often among `tokens`, ascending; ties, unseen tokens among them,
    go to the lower id."""
    counts = torch.bincount(tokens, minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:count].sort().values


def _read_shard(path: Path) -> list[TrainingExample]:
    tensors = load_file(str(path))
    lengths = tensors["lengths"].tolist()
    ids = tensors["token_ids"].long().split(lengths)
    masks = tensors["loss_mask"].bool().split(lengths)
    mapped = np.load(path.with_suffix(".npy"), mmap_mode="r")  # [tokens, F'] fp16, on disk
    with warnings.catch_warnings():  # read-only memory: the objective only reads it
        warnings.simplefilter("ignore", UserWarning)
        features = torch.from_numpy(mapped).split(lengths)
    return [TrainingExample(i, f, m) for i, f, m in zip(ids, features, masks)]


def _length_batches(sequences: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    batches, current = [], []
    for seq in sequences:
        if current and sum(map(len, current)) + len(seq) > max_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    return batches + ([current] if current else [])


def _token_batches(
    examples: list[TrainingExample], batch_tokens: int, rng: random.Random
) -> list[list[TrainingExample]]:
    order = list(examples)
    rng.shuffle(order)
    batches, current, size = [], [], 0
    for example in order:
        if current and size + len(example.token_ids) > batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(example)
        size += len(example.token_ids)
    return batches + ([current] if current else [])


def _learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_head(config: TrainConfig) -> Path:
    trainer = HeadTrainer(config)
    return trainer.train(trainer.cache_features())
