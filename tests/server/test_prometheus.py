"""A real Prometheus (the Debian package's binary, on loopback) scrapes a live speculating server
with configs/prometheus.yml's job; the speculation series and the dashboard's own expressions
come back from its query API after some requests."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.dashboard import as_promql, load_dashboard, targets
from tests.server.conftest import SPEC_DEPTH, SPEC_NAME, LiveServer, free_port
from tests.tools import REPO, find_tool

SCRAPE_INTERVAL_S = 1


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def prometheus(spec_server: LiveServer, tmp_path_factory) -> Iterator[Prometheus]:
    """Prometheus with configs/prometheus.yml, its target pointed at the live server."""
    root = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((REPO / "configs" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{spec_server.port}"]}]
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (root / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            find_tool("prometheus"),
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", root / "prometheus.log")
        yield Prometheus(port)
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(15)
        if process.poll() is None:
            process.kill()
            process.wait(5)
        log.close()


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"prometheus exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"prometheus not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def server_value(server: LiveServer, name: str) -> float:
    return server.metrics()[name]


@pytest.fixture(scope="module")
def scraped(spec_server: LiveServer, prometheus: Prometheus) -> Prometheus:
    """Some requests spread over a few scrapes, then wait until Prometheus holds their totals."""
    wait_for(lambda: prometheus.value('up{job="aerie"}') == 1, 20, "the first scrape")
    with spec_server.client() as client:
        for i in range(8):
            client.completions.create(
                model=SPEC_NAME,
                prompt=f"request {i} for prometheus: ",
                max_tokens=32,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            time.sleep(0.25)
    accepted = server_value(spec_server, "aerie_spec_decode_num_accepted_tokens_total")
    wait_for(
        lambda: prometheus.value("aerie_spec_decode_num_accepted_tokens_total") == accepted,
        15,
        "a scrape after the last request",
    )
    time.sleep(2 * SCRAPE_INTERVAL_S)  # two more samples, so rate() sees the end of the traffic
    return prometheus


def test_prometheus_scrapes_the_server(scraped: Prometheus) -> None:
    (up,) = scraped.query('up{job="aerie"}')
    assert up["value"][1] == "1"


def test_the_speculation_series_come_back(scraped: Prometheus, spec_server: LiveServer) -> None:
    live = spec_server.metrics()
    for name in (
        "aerie_spec_decode_num_drafts_total",
        "aerie_spec_decode_num_draft_tokens_total",
        "aerie_spec_decode_num_accepted_tokens_total",
        "aerie_spec_decode_tokens_per_pass_count",
        "aerie_spec_decode_tokens_per_pass_sum",
    ):
        (series,) = scraped.query(f'{name}{{job="aerie", model_name="{SPEC_NAME}"}}')
        assert float(series["value"][1]) == live[name] > 0, name
    positions = scraped.query("aerie_spec_decode_num_accepted_tokens_per_pos_total")
    assert sorted(int(s["metric"]["position"]) for s in positions) == list(range(1, SPEC_DEPTH + 1))
    assert (
        sum(float(s["value"][1]) for s in positions)
        == live["aerie_spec_decode_num_accepted_tokens_total"]
    )


def test_every_dashboard_query_runs_on_real_data(scraped: Prometheus) -> None:
    """Prometheus evaluates each panel's expression; the speculation panels have values."""
    results = {}
    for panel, target in targets(load_dashboard()):
        expr = as_promql(target["expr"], rate_interval="1m")
        results[(panel["title"], target["refId"])] = scraped.query(expr)
    assert all(isinstance(r, list) for r in results.values())

    def values(title: str, ref: str = "A") -> list[float]:
        return [float(s["value"][1]) for s in results[(title, ref)]]

    (rate,) = values("Acceptance rate")
    assert 0 < rate <= 1
    (length,) = values("Mean acceptance length")
    assert 1 < length <= SPEC_DEPTH + 1
    by_position = {
        int(s["metric"]["position"]): float(s["value"][1])
        for s in results[("Acceptance by position", "A")]
    }
    assert sorted(by_position) == list(range(1, SPEC_DEPTH + 1))
    ordered = [by_position[k] for k in sorted(by_position)]
    assert 0 < ordered[0] <= 1 and ordered == sorted(ordered, reverse=True)
    draft_rate, accepted_rate, output_rate = (
        values("Draft vs accepted tokens", ref)[0] for ref in "ABC"
    )
    assert draft_rate > accepted_rate > 0 and output_rate > 0
    (tokens_per_second,) = values("Output tokens / s")
    assert tokens_per_second > 0
    (p50,) = values("Time to first token")
    assert 0 < p50 < 10
