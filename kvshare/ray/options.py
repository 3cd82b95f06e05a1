"""The options of the Ray Serve application (`serve run kvshare.ray:build_app KEY=VALUE ...`),
checked before anything is deployed: a typo or a bad value is one error naming the option, not
N replicas failing to start on the cluster. No Ray import here, so the checks run anywhere."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from kvshare.config import EngineConfig
from kvshare.server.routing import ROUTING_POLICIES
from kvshare.server.settings import ServerConfig

# Engine options the application sets for each replica itself: where its KV events are published
# (an ephemeral port on its node, reported to the routers), its rank, and that its events carry
# no token ids (the sockets are unauthenticated and on the node's network; routers need only hashes).
REPLICA_SET = frozenset({"kv_events_endpoint", "kv_events_replay_endpoint", "data_parallel_rank",
                         "kv_events_token_ids", "kv_events_allow_remote"})
ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in REPLICA_SET)
# ServerConfig options that mean something behind Ray Serve (host, port and the drain are Serve's).
SERVER_OPTIONS = ("served_model_name", "api_key", "max_waiting", "request_timeout", "max_body_bytes",
                  "chat_template", "enable_auto_tool_choice", "tool_call_parser", "grammar_compile_timeout",
                  "log_prompts", "max_concurrent_grammar_compiles", "max_tools_bytes",
                  "max_chat_template_kwargs_bytes", "chat_template_timeout", "max_sequences_per_request",
                  "max_stop_strings", "max_stop_string_length", "max_stop_token_ids")
APP_OPTIONS = ("num_replicas", "routing_policy", "num_cpus_per_replica", "max_ongoing_requests",
               "kv_events_host", "routing_stats_period_s")
# `serve run kvshare.ray:app` (no arguments) reads its options from KVSHARE_RAY_<OPTION> variables.
ENV_PREFIX = "KVSHARE_RAY_"
API_KEY_ENV = "KVSHARE_API_KEY"  # `kvshare serve`'s; KVSHARE_RAY_API_KEY (kvshare.ray:app) wins over it


@dataclass
class RayAppOptions:
    num_replicas: int = 2
    routing_policy: str = "prefix_aware"
    num_cpus_per_replica: float = 1.0  # Ray's reservation; the engine runs this many torch threads (at least 1)
    max_ongoing_requests: int | None = None  # per replica; None: max_num_seqs + max_waiting (or 2 x max_num_seqs)
    kv_events_host: str | None = None  # where a replica binds its KV event sockets; None: its node's IP
    routing_stats_period_s: float = 1.0  # how often each replica's KV usage reaches the routers
    engine: dict = field(default_factory=dict)  # EngineConfig keyword arguments
    server: dict = field(default_factory=dict)  # ServerConfig keyword arguments


# Byte sizes, given as `kvshare serve` takes them (4MiB or a number): ServerConfig parses them.
SIZE_OPTIONS = frozenset({"max_body_bytes", "max_tools_bytes", "max_chat_template_kwargs_bytes"})


def _convert(name: str, value, annotation: str, default):
    """A `serve run` argument (always a string) as the option's type; other values as given."""
    if not isinstance(value, str) or annotation.strip() == "str" or name in SIZE_OPTIONS:
        return value
    kinds = {k.strip() for k in annotation.split("|")}
    if "None" in kinds and value.lower() in ("none", "null", ""):
        return None
    if "bool" in kinds or isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={value!r} is invalid: must be true or false")
    if "int" in kinds:
        try:
            return int(value)
        except ValueError:
            if "str" in kinds:
                return value  # e.g. kv_cache_memory=512MiB
            raise ValueError(f"{name}={value!r} is invalid: must be an integer") from None
    if "float" in kinds:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is invalid: must be a number") from None
    return value


def _annotations(cls) -> dict[str, tuple[str, object]]:
    return {f.name: (str(f.type), f.default) for f in dataclasses.fields(cls)}


def parse_app_args(args: dict, environ=None) -> RayAppOptions:
    """RayAppOptions from `serve run` arguments or a dict; raises ValueError naming a bad one.
    Without an api_key option, KVSHARE_API_KEY's (as `kvshare serve` reads it): a key given on
    `serve run`'s command line is visible to every user of the machine (ps)."""
    environ = os.environ if environ is None else environ
    engine_fields = _annotations(EngineConfig)
    server_fields = _annotations(ServerConfig)
    app_fields = _annotations(RayAppOptions)
    opts = RayAppOptions()
    for name, value in args.items():
        if name in APP_OPTIONS:
            ann, default = app_fields[name]
            setattr(opts, name, _convert(name, value, ann, default))
        elif name in ENGINE_OPTIONS:
            ann, default = engine_fields[name]
            opts.engine[name] = _convert(name, value, ann, default)
        elif name in SERVER_OPTIONS:
            if name == "api_key" and value == "":  # never "no key": an empty key must not turn auth off
                raise ValueError("api_key is empty: give a non-empty key, or leave the option out to serve without one")
            ann, default = server_fields[name]
            opts.server[name] = _convert(name, value, ann, default)
        elif name in REPLICA_SET:
            raise ValueError(f"{name} is set by the application for each replica (its KV events go to an "
                             f"ephemeral port on its node without token ids, its rank is its Serve replica "
                             f"rank): leave it out")
        else:
            raise ValueError(f"unknown option {name!r} for kvshare.ray: allowed are {', '.join(APP_OPTIONS)}; "
                             f"engine options {', '.join(ENGINE_OPTIONS)}; server options {', '.join(SERVER_OPTIONS)}")
    if isinstance(opts.num_replicas, bool) or not isinstance(opts.num_replicas, int) or opts.num_replicas < 1:
        raise ValueError(f"num_replicas={opts.num_replicas!r} is invalid: must be an integer >= 1")
    if opts.routing_policy not in ROUTING_POLICIES:
        raise ValueError(f"routing_policy={opts.routing_policy!r} is invalid: allowed are {', '.join(ROUTING_POLICIES)}")
    if not isinstance(opts.num_cpus_per_replica, (int, float)) or not opts.num_cpus_per_replica > 0:
        raise ValueError(f"num_cpus_per_replica={opts.num_cpus_per_replica!r} is invalid: must be a number > 0")
    if opts.max_ongoing_requests is not None and (not isinstance(opts.max_ongoing_requests, int)
                                                  or opts.max_ongoing_requests < 1):
        raise ValueError(f"max_ongoing_requests={opts.max_ongoing_requests!r} is invalid: must be an integer >= 1")
    if not isinstance(opts.routing_stats_period_s, (int, float)) or not opts.routing_stats_period_s > 0:
        raise ValueError(f"routing_stats_period_s={opts.routing_stats_period_s!r} is invalid: must be > 0 seconds")
    # The same checks as `kvshare serve`, before anything is deployed.
    engine = EngineConfig.from_kwargs(**opts.engine)
    if opts.routing_policy == "prefix_aware" and not engine.enable_prefix_caching:
        raise ValueError("routing_policy='prefix_aware' needs enable_prefix_caching: without a prefix cache there "
                         "is nothing to route by (choose least_loaded or round_robin)")
    server = {**opts.server}
    if server.get("api_key") is None and environ.get(API_KEY_ENV) is not None:
        if not environ[API_KEY_ENV]:
            raise ValueError(f"{API_KEY_ENV} is set but empty: set it to a key, or unset it to serve without one")
        server["api_key"] = environ[API_KEY_ENV]
    if server.get("chat_template") is not None:  # a file path, as --chat-template; replicas get its text
        from kvshare.server.cli import read_chat_template

        server["chat_template"] = read_chat_template(server["chat_template"])
    ServerConfig(**server)
    opts.server = server
    return opts


def args_from_env(environ=None) -> dict:
    """`serve run kvshare.ray:app` options from KVSHARE_RAY_<OPTION> variables (e.g.
    KVSHARE_RAY_NUM_REPLICAS=2, KVSHARE_RAY_MAX_NUM_SEQS=8)."""
    environ = os.environ if environ is None else environ
    return {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX) and v != ""}


def max_ongoing(opts: RayAppOptions) -> int:
    """Requests Serve sends one replica at once: its running batch plus its waiting room, so the
    engine's own queue (and its 429) decides, not a Serve-side queue in front of it."""
    if opts.max_ongoing_requests is not None:
        return opts.max_ongoing_requests
    engine = EngineConfig.from_kwargs(**opts.engine)
    waiting = opts.server.get("max_waiting")
    return engine.max_num_seqs + (waiting if waiting is not None else engine.max_num_seqs)
