"""`aerie bench serve`: a load generator for any OpenAI-compatible server (Aerie, vLLM, SGLang).

For each concurrency C it keeps C streaming `/v1/chat/completions` requests in flight (closed
loop) until `--num-prompts` have been sent or `--max-duration` seconds have passed, and reports
what vLLM's serving benchmark reports, defined the same way:

* request throughput: completed requests / wall time of the level;
* output throughput: completion tokens (from the final usage chunk) / wall time;
* TTFT: send to first content chunk; e2e latency: send to last chunk;
* TPOT: per request, (e2e - TTFT) / (completion tokens - 1);
* ITL: the gaps between consecutive content chunks, pooled over requests (a chunk carrying several
  tokens, as a speculative step sends, counts as one gap, as in vLLM).

Latencies come as mean, p50 and p99 in milliseconds. Results merge into a JSON file under a label
(one per server configuration), and a PNG plots output tokens/s and p99 ITL against concurrency,
one line per label.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from engine.errors import AerieError


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    prompts: Path
    category: str | None = None  # only the prompts of this "category" (e.g. the dev set's "code")
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    max_tokens: int = 128
    num_prompts: int = 0  # per level; 0: max(8, 4 * concurrency)
    max_duration: float = 120.0  # seconds per level after which no new request starts
    first_request: int = 0  # request i is the level's i-th from here (a slice's own requests)
    temperature: float = 0.0
    ignore_eos: bool = False
    # Request i asks for max_tokens drawn from [max_tokens (1 - r), max_tokens (1 + r)], the same
    # for every server (seeded by i), as vLLM's --random-range-ratio: requests of one length
    # started together finish together, a lockstep that real traffic does not have.
    range_ratio: float = 0.0
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    label: str = "server"
    out: Path | None = None  # JSON to merge results into; a PNG is written beside it

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise AerieError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


@dataclass
class RequestRecord:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def load_prompts(path: Path, category: str | None = None) -> list[list[dict]]:
    """Chat messages per line of a JSONL: {"messages": [...]}, {"prompt": "..."} or MT-bench's
    {"turns": [...]} (its first turn); with `category`, only the lines whose "category" it is."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if category is not None and record.get("category") != category:
            continue
        if "messages" in record:
            prompts.append(record["messages"])
        elif "prompt" in record:
            prompts.append([{"role": "user", "content": record["prompt"]}])
        elif "turns" in record:
            prompts.append([{"role": "user", "content": record["turns"][0]}])
        else:
            raise AerieError(f"{path}:{number}: expected 'messages', 'prompt' or 'turns'")
    if not prompts:
        raise AerieError(f"{path}: no prompts" + (f" of category {category!r}" if category else ""))
    return prompts


def run_benchmark(config: BenchConfig) -> dict:
    """Run the sweep; merge its results into `config.out` (and plot them) when given."""
    return asyncio.run(_sweep(config))


async def _sweep(config: BenchConfig) -> dict:
    import httpx

    prompts = load_prompts(config.prompts, config.category)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    timeout = httpx.Timeout(config.max_duration + 600.0)
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = config.model or await _first_model(client)
        levels = []
        for concurrency in config.concurrency:
            levels.append(await _run_level(client, model, prompts, concurrency, config))
    result = {
        "label": config.label,
        "model": model,
        "settings": _settings(config),
        "levels": levels,
    }
    if config.out is not None:
        merge_results(Path(config.out), result)
    return result


async def _first_model(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _run_level(client, model: str, prompts, concurrency: int, config: BenchConfig) -> dict:
    total = config.num_prompts or max(8, 4 * concurrency)
    queue = iter(range(config.first_request, config.first_request + total))
    records: list[RequestRecord] = []
    bar = tqdm(total=total, desc=f"{config.label} @ concurrency {concurrency}", unit="req")
    started = time.perf_counter()
    deadline = started + config.max_duration

    async def worker() -> None:
        for index in queue:
            if time.perf_counter() > deadline:
                return
            messages = prompts[index % len(prompts)]
            max_tokens = output_length(config.max_tokens, config.range_ratio, index)
            records.append(await _one_request(client, model, messages, max_tokens, config))
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    bar.close()
    return summarize(records, concurrency, elapsed)


def output_length(max_tokens: int, range_ratio: float, index: int) -> int:
    """Request `index`'s max_tokens: uniform over max_tokens (1 +- range_ratio), seeded by index."""
    low = max(1, round(max_tokens * (1 - range_ratio)))
    high = max(low, round(max_tokens * (1 + range_ratio)))
    return random.Random(index).randint(low, high)


async def _one_request(
    client, model: str, messages, max_tokens: int, config: BenchConfig
) -> RequestRecord:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    record = RequestRecord(ok=False)
    sent = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for data in _sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.itls.append(now - last)
                    last = now
        record.e2e = (last or time.perf_counter()) - sent
        record.ok = True
    except Exception as exc:  # a failed request is reported, not fatal to the sweep
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _sse_data(response):
    """The `data:` payloads of a server-sent event stream. Lines end at LF (or CRLF) only:
    str.splitlines would also break at U+2028 and friends, which JSON may carry unescaped."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[len(b"data: ") :].rstrip(b"\r").decode()


def summarize(records: list[RequestRecord], concurrency: int, elapsed: float) -> dict:
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": elapsed,
        "output_tokens": tokens,
        "request_throughput": len(done) / elapsed,
        "output_throughput": tokens / elapsed,
    }
    for name, values in (
        ("ttft", [r.ttft for r in done]),
        ("tpot", tpots),
        ("itl", [gap for r in done for gap in r.itls]),
        ("e2e", [r.e2e for r in done]),
    ):
        summary.update(_latency_stats(name, values))
    errors = sorted({r.error for r in records if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _latency_stats(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {f"{stat}_{name}_ms": None for stat in ("mean", "p50", "p99")}
    ordered = sorted(seconds)
    return {
        f"mean_{name}_ms": 1000 * sum(ordered) / len(ordered),
        f"p50_{name}_ms": 1000 * _percentile(ordered, 50),
        f"p99_{name}_ms": 1000 * _percentile(ordered, 99),
    }


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _settings(config: BenchConfig) -> dict:
    settings = asdict(config)
    settings["prompts"] = str(config.prompts)
    settings["out"] = str(config.out) if config.out else None
    settings.pop("api_key")
    return settings


def merge_results(path: Path, result: dict) -> None:
    """Put `result` into the JSON at `path` under its label (replacing an earlier run of that
    label), then redraw the plot beside it."""
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    data["runs"][result["label"]] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    plot_results(data, path.with_suffix(".png"))


def ratios_to_reference(runs: dict, reference: str) -> dict:
    """Each other run's output tokens/s and median TPOT over `reference`'s, per concurrency, trial
    by trial (a trial: one slice of one round, which the two servers ran back to back, so a slow
    spell of the machine hits both): every trial's ratio, their geometric mean, and its 95%
    interval over rounds and trials. A second process of the reference's configuration shows
    the run's own noise."""
    if reference not in runs:
        return {}
    theirs = {level["concurrency"]: level for level in runs[reference]["levels"]}
    ratios = {}
    for label, run in runs.items():
        if label == reference:
            continue
        ratios[label] = {
            str(level["concurrency"]): _paired(level, theirs[level["concurrency"]])
            for level in run["levels"]
            if level["concurrency"] in theirs
        }
    return ratios


def _paired(level: dict, reference: dict) -> dict:
    """{"throughput": geometric mean, "throughput_ci95": [low, high], "throughput_trials": [...],
    and the same for "tpot" (median TPOT) where every trial has it}."""
    pairs = list(zip(level.get("trials", [level]), reference.get("trials", [reference])))
    rounds = [ours.get("round", 0) for ours, _ in pairs]
    summary = {}
    for name, key in (("throughput", "output_throughput"), ("tpot", "p50_tpot_ms")):
        if all(ours.get(key) and theirs.get(key) for ours, theirs in pairs):
            values = [ours[key] / theirs[key] for ours, theirs in pairs]
            summary |= {
                name: statistics.geometric_mean(values),
                f"{name}_ci95": bootstrap_interval(values, rounds),
                f"{name}_trials": values,
            }
    return summary


def bootstrap_interval(
    ratios: list[float], rounds: list[int] | None = None, resamples: int = 10_000
) -> list[float]:
    """The 95% percentile-bootstrap interval of the ratios' geometric mean, resampling rounds
    and then each drawn round's trials: a round's servers keep their own speed for their life,
    so its trials are not independent and the interval must widen with the rounds' spread. Seeded:
    a results file's interval is reproducible from its trials."""
    rng = random.Random(0)
    by_round: dict[int, list[float]] = {}
    for ratio, round_index in zip(ratios, rounds or [0] * len(ratios)):
        by_round.setdefault(round_index, []).append(math.log(ratio))
    groups = list(by_round.values())
    means = []
    for _ in range(resamples):
        drawn = rng.choices(groups, k=len(groups))
        means.append(statistics.fmean(x for g in drawn for x in rng.choices(g, k=len(g))))
    means.sort()
    return [math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])]


def plot_results(data: dict, path: Path) -> None:
    """Output tokens/s and p99 ITL against concurrency, one line per label (needs matplotlib:
    `pip install aerie[bench]`)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot at {path}: matplotlib is not installed (pip install 'aerie[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, run in data["runs"].items():
        levels = run["levels"]
        concurrency = [level["concurrency"] for level in levels]
        throughput.plot(concurrency, [lv["output_throughput"] for lv in levels], "o-", label=label)
        if any(lv.get("p99_itl_ms") is not None for lv in levels):
            itl.plot(concurrency, [lv.get("p99_itl_ms") for lv in levels], "o-", label=label)
    for axes, title in ((throughput, "output tokens/s"), (itl, "p99 inter-token latency (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent requests")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
