"""Command-line flags for every EngineConfig field, generated from the dataclass itself."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from engine.config import EngineConfig
from engine.spec.draft_method import resolve_draft

_SKIPPED = {"model", "draft"}  # each command declares --model and --draft itself


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    group.add_argument("--config", help="YAML preset of engine options (see configs/)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in _SKIPPED:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        if kind is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"default: {field.default}",
            )
        else:
            group.add_argument(flag, type=kind, default=None, help=f"default: {field.default}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Flags given on the command line override the YAML preset, which overrides the defaults."""
    options = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in _SKIPPED and getattr(args, f.name) is not None
    }
    options["draft"] = resolve_draft(args.model, args.draft)
    if args.config:
        return EngineConfig.from_yaml(args.config, model=args.model, **options)
    return EngineConfig.from_options(args.model, **options)


def _base_type(hint) -> type:
    """`int | None` -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
