"""The engine options shared by every command that builds an engine (`generate`, `info`,
`serve`, `doctor`): their argparse flags, and the EngineConfig keyword arguments they map to.
Both are built from EngineConfig's fields (kvshare.config: each option's default, type and
Flag), so the flags cannot drift from the Python API."""
from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields

from kvshare.config import HASH_SEED_ENV, EngineConfig, Flag

__all__ = ["HASH_SEED_ENV", "add_engine_args", "engine_options", "flagged_options", "flag_dest"]

# A flag kept for compatibility that sets no option of its own (checked in kv_events_token_ids).
RETIRED_NO_TOKEN_IDS = "--kv-events-no-token-ids"


def flagged_options() -> list[tuple[Field, Flag]]:
    """EngineConfig's fields that have a command-line flag, in declaration order."""
    return [(f, f.metadata["flag"]) for f in fields(EngineConfig) if f.metadata.get("flag") is not None]


def flag_name(f: Field, flag: Flag) -> str:
    return flag.name or "--" + f.name.replace("_", "-")


def flag_dest(f: Field, flag: Flag) -> str:
    """The argparse attribute the flag fills (its long name, as argparse derives it)."""
    return flag_name(f, flag)[2:].replace("-", "_")


def _flag_type(annotation: str):
    kinds = {k.strip() for k in str(annotation).split("|")} - {"None"}
    return {frozenset({"int"}): int, frozenset({"float"}): float}.get(frozenset(kinds))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    for f, flag in flagged_options():
        kwargs: dict = {}
        if flag.help is not None:
            kwargs["help"] = flag.help.format(default=f.default, env=flag.env)
        if str(f.type) == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["default"] = (os.environ.get(flag.env) if flag.env else None) or f.default
            if _flag_type(f.type) is not None:
                kwargs["type"] = _flag_type(f.type)
            if flag.choices is not None:
                kwargs["choices"] = list(flag.choices)
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
        g.add_argument(flag_name(f, flag), *flag.aliases, **kwargs)
        if f.name == "kv_events_token_ids":
            g.add_argument(RETIRED_NO_TOKEN_IDS, action="store_true",
                           help="accepted for compatibility: empty token_ids are the default now")


def kv_events_token_ids(args: argparse.Namespace) -> bool:
    if args.kv_events_token_ids and args.kv_events_no_token_ids:
        raise ValueError("--kv-events-token-ids and --kv-events-no-token-ids contradict each other: give one "
                         "(without either, token_ids are empty)")
    return args.kv_events_token_ids


def engine_options(args: argparse.Namespace) -> dict:
    options = {}
    for f, flag in flagged_options():
        value = getattr(args, flag_dest(f, flag))
        if flag.negate:
            value = not value
        if flag.only_when_given and not value:
            continue
        options[f.name] = value
    options["kv_events_token_ids"] = kv_events_token_ids(args)
    return options
