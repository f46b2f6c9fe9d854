"""/metrics on a live speculating server: the exposition passes `promtool check metrics`, holds
exactly the documented families, and each series moves by what the traffic did."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics, one_two_five_buckets
from tests.deploy.dashboard import load_dashboard, queried_metrics
from tests.server.conftest import (
    SPEC_DEPTH,
    SPEC_NAME,
    SPEC_TOTAL_TOKENS,
    TINY_NAME,
    LiveServer,
    spec_server_args,
    sse_events,
    start_server,
)
from tests.tools import REPO, run_tool

# Every family /metrics exposes for a speculating server, with its type (as in `# TYPE`).
CATALOGUE = {
    "aerie_num_requests_running": "gauge",
    "aerie_num_requests_waiting": "gauge",
    "aerie_kv_cache_usage_ratio": "gauge",
    "aerie_num_preemptions_total": "counter",
    "aerie_prefix_cache_queries_total": "counter",
    "aerie_prefix_cache_hits_total": "counter",
    "aerie_prompt_tokens_total": "counter",
    "aerie_generation_tokens_total": "counter",
    "aerie_request_success_total": "counter",
    "aerie_time_to_first_token_seconds": "histogram",
    "aerie_inter_token_latency_seconds": "histogram",
    "aerie_e2e_request_latency_seconds": "histogram",
    "aerie_request_queue_time_seconds": "histogram",
    "aerie_request_prompt_tokens": "histogram",
    "aerie_request_generation_tokens": "histogram",
    "aerie_step_phase_seconds_total": "counter",
    "aerie_spec_decode_num_drafts_total": "counter",
    "aerie_spec_decode_num_draft_tokens_total": "counter",
    "aerie_spec_decode_num_accepted_tokens_total": "counter",
    "aerie_spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "aerie_spec_decode_tokens_per_pass": "histogram",
    "aerie_spec_decode_draft_budget_tokens": "histogram",
    "aerie_spec_decode_plain_steps_total": "counter",
    "aerie_spec_decode_steps_by_batch_total": "counter",
    "aerie_spec_decode_drafting_steps_by_batch_total": "counter",
}
SPEC_FAMILIES = {name for name in CATALOGUE if name.startswith("aerie_spec_decode_")}


class Scrape:
    """One /metrics page: sample values by (name, labels other than model_name)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.values: dict[tuple[str, frozenset], float] = {}
        self.model_names: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                labels = dict(sample.labels)
                self.model_names.add(labels.pop("model_name", None))
                self.values[(sample.name, frozenset(labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]

    @property
    def sample_names(self) -> set[str]:
        return {name for name, _ in self.values}


def scrape(server: LiveServer) -> Scrape:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


def complete(server: LiveServer, prompt: str, max_tokens: int, **options) -> dict:
    body = {
        "model": SPEC_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **options,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def one_request(spec_server) -> dict:
    """/metrics just before and just after one greedy request of 24 tokens. The engine publishes
    a step's stats before it hands out that step's tokens, so the second scrape is complete."""
    before = scrape(spec_server)
    body = complete(spec_server, "one request, alone: ", 24)
    return {"before": before, "after": scrape(spec_server), "usage": body["usage"]}


def delta(one_request: dict, name: str, **labels: str) -> float:
    return one_request["after"](name, **labels) - one_request["before"](name, **labels)


@pytest.fixture(scope="module")
def traffic(spec_server, one_request) -> Scrape:
    """A mix of requests (chat, completions, n=2, sampled, streamed), then /metrics."""
    with spec_server.client() as client:
        client.chat.completions.create(
            model=SPEC_NAME,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=16,
            temperature=0,
        )
        client.completions.create(
            model=SPEC_NAME, prompt="two choices: ", n=2, max_tokens=12, temperature=0.8, seed=1
        )
        stream = client.completions.create(
            model=SPEC_NAME, prompt="streamed: ", max_tokens=20, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    return scrape(spec_server)


# ------------------------------------------------------------------------------- exposition
def test_the_exposition_passes_promtool(traffic) -> None:
    result = run_tool("promtool", "check", "metrics", input=traffic.text)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )


def test_promtool_flags_a_bad_exposition() -> None:
    """The check above can fail: a counter without `_total` and with no help text."""
    bad = "# TYPE aerie_bad counter\naerie_bad 1\n"
    assert run_tool("promtool", "check", "metrics", input=bad).returncode != 0


def test_the_families_are_exactly_the_catalogue(traffic) -> None:
    types = {
        name + ("_total" if kind == "counter" else ""): kind for name, kind in traffic.types.items()
    }
    assert types == CATALOGUE
    assert traffic.model_names == {SPEC_NAME}, "every series carries the served model name"


def test_labelled_series_exist_for_every_value(traffic) -> None:
    for reason in ("stop", "length", "abort"):
        traffic("aerie_request_success_total", finished_reason=reason)
    for position in range(1, SPEC_DEPTH + 1):
        traffic("aerie_spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
    for phase in ("propose", "verify", "accept", "other"):
        assert traffic("aerie_step_phase_seconds_total", phase=phase) > 0
    buckets = [
        float(dict(labels)["le"])
        for name, labels in traffic.values
        if name == "aerie_spec_decode_tokens_per_pass_bucket"
    ]
    assert sorted(buckets)[:-1] == [float(k) for k in range(1, SPEC_DEPTH + 2)]  # then +Inf


def test_the_metrics_doc_lists_every_metric() -> None:
    doc = (REPO / "docs" / "metrics.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in doc]
    assert not missing, f"docs/metrics.md's metric list lacks {missing}"


def test_the_dashboard_reads_only_live_series(traffic) -> None:
    missing = queried_metrics(load_dashboard()) - traffic.sample_names
    assert not missing, f"the dashboard queries series /metrics does not have: {missing}"


# ------------------------------------------------------------------------------- values
def test_a_request_counts_its_tokens_and_its_finish(one_request) -> None:
    usage = one_request["usage"]
    assert usage["completion_tokens"] == 24
    assert delta(one_request, "aerie_generation_tokens_total") == 24
    assert delta(one_request, "aerie_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta(one_request, "aerie_request_success_total", finished_reason="length") == 1
    assert delta(one_request, "aerie_request_success_total", finished_reason="stop") == 0
    assert delta(one_request, "aerie_request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta(one_request, "aerie_request_generation_tokens_sum") == 24
    for histogram in (
        "aerie_time_to_first_token_seconds",
        "aerie_e2e_request_latency_seconds",
        "aerie_request_queue_time_seconds",
        "aerie_request_prompt_tokens",
        "aerie_request_generation_tokens",
    ):
        assert delta(one_request, f"{histogram}_count") == 1, histogram
    assert delta(one_request, "aerie_inter_token_latency_seconds_count") == 23
    after = one_request["after"]
    assert after("aerie_num_requests_running") == 0
    assert after("aerie_num_requests_waiting") == 0
    assert after("aerie_kv_cache_usage_ratio") == 0


def test_latencies_add_up(one_request) -> None:
    """The inter-token latencies of a request cover exactly its time after the first token."""
    ttft = delta(one_request, "aerie_time_to_first_token_seconds_sum")
    e2e = delta(one_request, "aerie_e2e_request_latency_seconds_sum")
    itl = delta(one_request, "aerie_inter_token_latency_seconds_sum")
    queue = delta(one_request, "aerie_request_queue_time_seconds_sum")
    assert 0 <= queue <= ttft <= e2e < 30
    assert itl == pytest.approx(e2e - ttft, abs=1e-6)


def test_speculation_counts_drafts_and_accepted_tokens(one_request) -> None:
    drafts = delta(one_request, "aerie_spec_decode_num_drafts_total")
    draft_tokens = delta(one_request, "aerie_spec_decode_num_draft_tokens_total")
    accepted = delta(one_request, "aerie_spec_decode_num_accepted_tokens_total")
    per_pos = [
        delta(one_request, "aerie_spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
        for k in range(1, SPEC_DEPTH + 1)
    ]
    # 23 tokens after the prefill's first one, every decode pass verifies a draft tree
    assert 1 <= drafts <= 23
    assert drafts < draft_tokens <= drafts * (SPEC_TOTAL_TOKENS - 1)
    assert accepted > 0, "the trained head should get some drafts accepted"
    assert accepted == sum(per_pos)
    assert per_pos == sorted(per_pos, reverse=True), "depth k needs depth k - 1 accepted"
    assert per_pos[0] <= drafts
    assert delta(one_request, "aerie_spec_decode_tokens_per_pass_count") == drafts
    emitted = delta(one_request, "aerie_spec_decode_tokens_per_pass_sum")
    assert emitted == 23, "every token after the first came from a speculative pass"
    assert emitted <= accepted + drafts  # accepted + one bonus per pass, cut at max_tokens


def test_the_adaptive_budget_accounts_for_every_decode_step(spec_model, server_logs) -> None:
    """With the default adaptive budget, each decode step of a lone request either verifies the
    draft tokens its budget chose or decodes plainly, and the budget metrics say which."""
    target, head = spec_model
    server = start_server(
        target, server_logs, *spec_server_args(head), api_key=None, served_name=SPEC_NAME
    )
    try:
        before = scrape(server)
        complete(server, "one request, alone: ", 24)
        after = scrape(server)
    finally:
        server.stop()

    def change(name: str, **labels: str) -> float:  # a labelled sample first counted now is new
        key = (name, frozenset(labels.items()))
        return after.values.get(key, 0.0) - before.values.get(key, 0.0)

    steps = change("aerie_spec_decode_draft_budget_tokens_count")
    drafted = change("aerie_spec_decode_num_drafts_total")
    plain = change("aerie_spec_decode_plain_steps_total")
    assert steps == drafted + plain > 0
    assert change("aerie_spec_decode_draft_budget_tokens_sum") == change(
        "aerie_spec_decode_num_draft_tokens_total"
    )
    emitted = change("aerie_spec_decode_tokens_per_pass_sum")
    assert emitted + plain == 23, "each of the 23 tokens after the first came from a decode step"
    assert change("aerie_spec_decode_steps_by_batch_total", batch="1") == steps  # alone
    assert change("aerie_spec_decode_drafting_steps_by_batch_total", batch="1") == drafted


def test_a_repeated_prompt_hits_the_prefix_cache(spec_server) -> None:
    prompt = "a shared system prompt that is long enough to fill two blocks: "
    complete(spec_server, prompt, 4)
    before = scrape(spec_server)
    complete(spec_server, prompt, 4)
    after = scrape(spec_server)
    queries = after("aerie_prefix_cache_queries_total") - before("aerie_prefix_cache_queries_total")
    hits = after("aerie_prefix_cache_hits_total") - before("aerie_prefix_cache_hits_total")
    assert 32 <= hits <= queries


def test_an_abandoned_stream_counts_as_aborted(spec_server) -> None:
    before = scrape(spec_server)
    body = {
        "model": SPEC_NAME,
        "prompt": "abandoned: ",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=spec_server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        for index, _ in enumerate(sse_events(response)):
            if index == 2:
                break
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        after = scrape(spec_server)
        if after("aerie_request_success_total", finished_reason="abort") > before(
            "aerie_request_success_total", finished_reason="abort"
        ):
            break
        time.sleep(0.1)
    assert after("aerie_request_success_total", finished_reason="abort") == (
        before("aerie_request_success_total", finished_reason="abort") + 1
    )
    assert after("aerie_request_success_total", finished_reason="length") == before(
        "aerie_request_success_total", finished_reason="length"
    )
    assert after("aerie_num_requests_running") == 0
    assert after("aerie_kv_cache_usage_ratio") == 0


# ------------------------------------------------------------------------------- under load
# A pool of 24 blocks of 16 tokens (384) for at most 3 sequences of some 8 + 200 tokens (13 blocks
# each, 39 for three): they outgrow it together, so the newest are preempted; 5 requests for 3
# slots keep 2 waiting.
LOAD_FLAGS = ("--block-size", "16", "--num-kv-blocks", "24", "--max-num-seqs", "3")
NUM_LOAD_REQUESTS, LOAD_TOKENS = 5, 200


def test_the_gauges_move_under_load_and_settle_after_it(spawn) -> None:
    server = spawn(*LOAD_FLAGS)
    before = server.metrics()

    def long_request(index: int) -> dict:
        return complete(server, f"load {index}: ", LOAD_TOKENS, model=TINY_NAME)

    scrapes = []
    with ThreadPoolExecutor(NUM_LOAD_REQUESTS) as pool:
        replies = [pool.submit(long_request, i) for i in range(NUM_LOAD_REQUESTS)]
        while not all(reply.done() for reply in replies):
            scrapes.append(server.metrics())
            time.sleep(0.02)
        usages = [reply.result()["usage"]["completion_tokens"] for reply in replies]
    after = server.metrics()

    assert usages == [LOAD_TOKENS] * NUM_LOAD_REQUESTS
    assert max(s["aerie_num_requests_running"] for s in scrapes) > 0
    assert max(s["aerie_num_requests_running"] for s in scrapes) <= 3
    assert max(s["aerie_num_requests_waiting"] for s in scrapes) > 0, "5 requests, 3 slots"
    kv_usage = [s["aerie_kv_cache_usage_ratio"] for s in scrapes]
    assert 0 < max(kv_usage) <= 1 and min(kv_usage) >= 0
    preempted = after["aerie_num_preemptions_total"] - before["aerie_num_preemptions_total"]
    assert preempted > 0, "the sequences outgrew the pool together"
    assert after["aerie_num_requests_running"] == after["aerie_num_requests_waiting"] == 0
    assert after["aerie_kv_cache_usage_ratio"] == 0, "every block is free again"


# ------------------------------------------------------------------------------- offline
def test_the_engine_does_not_import_prometheus_client() -> None:
    """The engine emits plain stats records; only server/metrics.py knows Prometheus."""
    code = (
        "import sys, engine, engine.llm_engine, drafting.eagle_drafter\n"
        "tops = {name.split('.')[0] for name in sys.modules}\n"
        "print(sorted(tops & {'prometheus_client', 'server'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"imported by the engine: {result.stdout}"


def fake_engine(draft: str | None, depth: int = 4, max_model_len: int = 4096):
    config = SimpleNamespace(draft=draft, draft_depth=depth)
    return SimpleNamespace(config=config, max_model_len=max_model_len, stats_listeners=[])


def test_series_exist_at_zero_before_any_traffic() -> None:
    """Labelled series are created up front, so rate() and the dashboard work from the start;
    the speculation family exists only when a draft head is loaded."""
    plain, speculating = Metrics("m"), Metrics("m")
    plain_engine, spec_engine = fake_engine(None), fake_engine("head", depth=6)
    plain.attach(plain_engine)
    speculating.attach(spec_engine)
    assert plain_engine.stats_listeners == [plain.observe]
    plain_page = Scrape(plain.render()[0].decode())
    spec_page = Scrape(speculating.render()[0].decode())
    assert not any(name.startswith("aerie_spec_decode") for name in plain_page.types)
    assert spec_page("aerie_request_success_total", finished_reason="abort") == 0
    assert spec_page("aerie_spec_decode_num_accepted_tokens_per_pos_total", position="6") == 0
    assert spec_page("aerie_spec_decode_tokens_per_pass_count") == 0
    assert {n + "_total" if t == "counter" else n for n, t in spec_page.types.items()} == set(
        CATALOGUE
    )


def test_length_buckets_follow_the_context() -> None:
    assert one_two_five_buckets(4096) == (
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 4096.0,
    )  # fmt: skip
    assert one_two_five_buckets(1000) == (
        1.0,
        2.0,
        5.0,
        10.0,
        20.0,
        50.0,
        100.0,
        200.0,
        500.0,
        1000.0,
    )
