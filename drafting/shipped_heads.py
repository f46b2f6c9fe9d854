"""Which draft head `draft="auto"` means for a model: the heads Aerie ships, by model alias."""

from __future__ import annotations

from pathlib import Path

# Heads trained by `aerie train-head` and committed under drafting/heads/<alias>/.
_HEADS_DIR = Path(__file__).resolve().parent / "heads"


def shipped_head(model: str) -> Path | None:
    """The folder of the head shipped for `model` (an alias), or None (paths have none)."""
    if Path(model).name != model or Path(model).exists():
        return None
    folder = _HEADS_DIR / model
    return folder if (folder / "config.json").is_file() else None
