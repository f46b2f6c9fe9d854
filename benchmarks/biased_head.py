"""An EAGLE-3 head with random q/k/v biases, written back by Aerie: the file for the interop check
that vLLM reads such a head as Aerie computes it.

vLLM gives every attention layer of an EAGLE-3 head all four biases (q, k, v and o_proj) from one
config field, `attention_bias`. A head with q/k/v biases alone (a Qwen2-style layer) therefore
means something to vLLM only once Aerie's writer has added zero o_proj biases beside them; this
script adds the q/k/v biases to HEAD's file, loads that through Aerie's loader and writes it with
Aerie's writer into OUT, which `bench_vllm_interop.py OUT` then runs in both engines. Run from the
repository root:

    python benchmarks/biased_head.py HEAD OUT [--std 0.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafting.head_format import rope_fields
from drafting.head_loader import load_head, save_head
from engine.execution.model_files import DEFAULT_MODEL, load_config, resolve_model_path
from engine.execution.models.spec import ModelSpec

QKV_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def with_qkv_biases(head: Path, out: Path, std: float, seed: int) -> None:
    """Copy `head` into `out` with random q/k/v biases (N(0, std)) in every attention layer."""
    shutil.copytree(head, out, dirs_exist_ok=True)
    weights = load_file(head / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    projections = [n for n in weights if n.endswith(QKV_WEIGHTS)]
    for name in projections:
        weight = weights[name]  # [out_features, in_features]
        bias = torch.randn(weight.shape[0], generator=generator) * std
        weights[name.removesuffix("weight") + "bias"] = bias.to(weight.dtype)
    save_file(weights, out / "model.safetensors")


def rewritten(source: Path, out: Path, model: str) -> Path:
    """`source` loaded by Aerie against `model` and written back by Aerie, in fp16."""
    hf_config = load_config(resolve_model_path(model))
    spec = ModelSpec.from_hf_config(hf_config)
    head = load_head(
        source, spec, hf_config.max_position_embeddings, torch.device("cpu"), torch.float32
    )
    return save_head(head, out, rope_fields(hf_config), torch.float16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", type=Path, help="an EAGLE-3 head folder without attention biases")
    parser.add_argument("out", type=Path)
    parser.add_argument("--std", type=float, default=0.5, help="of the random biases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the head's target")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "head"
        with_qkv_biases(args.head, source, args.std, args.seed)
        print(rewritten(source, args.out, args.model))


if __name__ == "__main__":
    main()
