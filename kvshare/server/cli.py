"""`kvshare serve`: the OpenAI-compatible HTTP server on one engine, or on N data-parallel
replicas behind one front end (--data-parallel-size N, kvshare.server.data_parallel)."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os

from kvshare.engine_args import add_engine_args, engine_options
from kvshare.server.routing import ROUTING_POLICIES
from kvshare.server.settings import (DEFAULT_LIMIT_CONCURRENCY, DEFAULT_MAX_BODY_BYTES,
                                     DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES, DEFAULT_MAX_TOOLS_BYTES, server_default)
from kvshare.server.tool_parsers import TOOL_PARSERS


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    g = p.add_argument_group("server options")
    g.add_argument("--host", default=server_default("host"), help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=server_default("port"))
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: from the model file)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/, /tokenize, /detokenize, /openapi.json, /kv/ and "
                        "/dashboard (a browser: the key as Basic password); repeat for several keys, each its own "
                        "tenant api-key-N (default: $KVSHARE_API_KEY; unset: open, loopback Host names only)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more API keys with their tenants: lines 'KEY TENANT' (# comments; several keys may share "
                        "a tenant)")
    g.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the only key that opens /kv/ and /dashboard, which show every tenant's requests "
                        "(default: $KVSHARE_ADMIN_KEY; unset: any API key opens them)")
    g.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="isolate tenants' prefix caches: a request's cache salt is its API key's tenant with "
                        "its own cache_salt, so no tenant can hit (or learn of) another's cached prompts")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories or GGUF LoRA files) loaded at start, each served under "
                        "its NAME as a request's `model` (needs --enable-lora; also vLLM's JSON form "
                        "'{\"name\": NAME, \"path\": PATH}')")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="offer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key), "
                        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="answer 429 when this many requests already wait to be scheduled (default: unbounded)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="end a request this many seconds after arrival with finish_reason 'timeout' (its partial "
                        "output; 408 if it produced nothing); a request's own `timeout` may only be shorter")
    g.add_argument("--shutdown-timeout", type=float, default=server_default("shutdown_timeout"),
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    g.add_argument("--max-body-bytes", default=str(DEFAULT_MAX_BODY_BYTES),
                   help="largest request body accepted, e.g. 4MiB (413 beyond)")
    g.add_argument("--request-body-timeout", type=float, default=server_default("request_body_timeout"),
                   metavar="SECONDS",
                   help="answer 408 and close the connection when a request body has not fully arrived this many "
                        f"seconds after its headers (default: {server_default('request_body_timeout'):g})")
    g.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                   help=f"uvicorn's: answer 503 beyond N open connections or tasks (default: "
                        f"{DEFAULT_LIMIT_CONCURRENCY})")
    g.add_argument("--timeout-keep-alive", type=float, default=server_default("timeout_keep_alive"), metavar="SECONDS",
                   help="uvicorn's: close an idle keep-alive connection after this long "
                        f"(default: {server_default('timeout_keep_alive'):g})")
    g.add_argument("--log-prompts", action="store_true", help="log prompt text and parameters of every request")
    g.add_argument("--no-access-log", action="store_true", help="no per-request access log lines")
    g.add_argument("--log-level", default=server_default("log_level"),
                   choices=["critical", "error", "warning", "info", "debug"])
    lim = p.add_argument_group("per-request limits (400 beyond)")
    for name, metavar, text in (
            ("max_sequences_per_request", "N", "most sequences one request may ask for: its prompts x n"),
            ("max_stop_strings", "N", "most strings in a request's stop list"),
            ("max_stop_string_length", "CHARS", "longest stop string, in characters"),
            ("max_stop_token_ids", "N", "most token ids in a request's stop_token_ids")):
        lim.add_argument("--" + name.replace("_", "-"), type=int, default=server_default(name), metavar=metavar,
                         help=f"{text} (default: {server_default(name)})")
    t = p.add_argument_group("chat template and tool calling")
    t.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template to render chat requests with instead of the model's")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": calls are parsed out of the reply by --tool-call-parser')
    t.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how calls are written in the model's replies: hermes (Hermes, Qwen2.5/Qwen3 "
                        "<tool_call> JSON), llama3_json, pythonic")
    t.add_argument("--grammar-compile-timeout", type=float, default=server_default("grammar_compile_timeout"),
                   metavar="SECONDS",
                   help="refuse (400) a structured-output grammar that takes longer than this to compile; one "
                        "whose compile used more CPU time than this stays refused")
    t.add_argument("--max-concurrent-grammar-compiles", type=int,
                   default=server_default("max_concurrent_grammar_compiles"), metavar="N",
                   help="grammars compiled at once; a request waits for a free slot within "
                        "--grammar-compile-timeout, then gets 429 "
                        f"(default: {server_default('max_concurrent_grammar_compiles')})")
    t.add_argument("--max-tools-bytes", default=str(DEFAULT_MAX_TOOLS_BYTES),
                   help="largest 'tools' (as JSON) a chat request may give the template, e.g. 1MiB (400 beyond)")
    t.add_argument("--max-chat-template-kwargs-bytes", default=str(DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES),
                   help="largest 'chat_template_kwargs' (as JSON) a request may give, e.g. 64KiB (400 beyond)")
    t.add_argument("--chat-template-timeout", type=float, default=server_default("chat_template_timeout"),
                   metavar="SECONDS",
                   help=f"stop (400) rendering a chat template after this long "
                        f"(default: {server_default('chat_template_timeout'):g})")
    d = p.add_argument_group("data parallel (docs/data_parallel.md)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="run N engine replicas (each its own process, with its share of the CPU threads) behind "
                        "one front end on --port (default: 1, a single engine)")
    d.add_argument("--routing-policy", default="prefix_aware", choices=ROUTING_POLICIES,
                   help="how the front end picks a replica: prefix_aware (where the longest prefix of the prompt "
                        "is cached, balanced against load), round_robin, least_loaded (default: prefix_aware)")
    # Test-only: plant a known bug class (kvshare.testing.faults) so the dashboard's test can show
    # an audit violation on a real server (with --audit the engine stops at the violation). Hidden
    # from --help, and refused without KVSHARE_TESTING=1 or without --audit (cmd_serve).
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    # Test-only, with --inject-fault: no --audit, so the planted bug shows in the answers, as
    # `kvshare doctor --url` must find it from the outside (same KVSHARE_TESTING=1 gate).
    p.add_argument("--inject-fault-unaudited", action="store_true", help=argparse.SUPPRESS)
    # Internal: a replica serves the socket its data-parallel front end bound for it (fd inherited).
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    add_engine_args(p)
    # Unseeded requests must not repeat their samples each time the server restarts (--seed S to
    # have them repeat); a request's own seed reproduces either way.
    p.set_defaults(seed=None, func=functools.partial(cmd_serve, parser=p))


# Flags the front end sets for each replica itself (or keeps to itself), never passed through as given.
# The keys reach the replicas in their environment (kvshare.server.tenants.REPLICA_AUTH_ENV).
FRONTEND_ONLY = frozenset({"help", "host", "port", "api_key", "api_key_file", "admin_key", "no_access_log",
                           "data_parallel_size", "routing_policy",
                           "kv_events_endpoint", "kv_events_replay_endpoint", "prefix_caching_hash_seed",
                           "data_parallel_rank", "listen_fd"})


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: dict) -> list[str]:
    """The `kvshare serve` arguments of one replica: every flag the user gave (or that differs from
    its default) except the front end's own, then `overrides` (dest -> value)."""
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in FRONTEND_ONLY:
            continue
        flag = max(action.option_strings, key=len)
        value = getattr(args, action.dest, action.default)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif isinstance(action, argparse._StoreAction):
            if isinstance(value, list):  # (nargs="+": --lora-modules a=x b=y)
                out += [flag, *map(str, value)] if value else []
            elif value is not None and value != action.default:
                out += [flag, str(value)]
        else:
            raise TypeError(f"replica_argv cannot pass {flag} on ({type(action).__name__})")
    for dest, value in overrides.items():
        out += ["--" + dest.replace("_", "-"), str(value)]
    return out


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read the template file ({e})") from None


def auth_options(args: argparse.Namespace, environ) -> dict:
    """ServerConfig's api_keys and admin_key: from the flags and environment, or for a
    data-parallel replica those its front end handed it (never on its command line; taken out of
    `environ`, so nothing the replica starts inherits them)."""
    from kvshare.server.tenants import REPLICA_AUTH_ENV, admin_key_from_args, keys_from_args

    if args.listen_fd is not None and REPLICA_AUTH_ENV in environ:
        return json.loads(environ.pop(REPLICA_AUTH_ENV))
    return {"api_keys": keys_from_args(args.api_key, args.api_key_file, environ),
            "admin_key": admin_key_from_args(args.admin_key, environ)}


def check_inject_fault(args: argparse.Namespace) -> None:
    """--inject-fault plants a bug that corrupts other requests' KV on purpose: it runs only in a
    testing environment (KVSHARE_TESTING=1, kvshare.testing.environment) and with the explicit
    --audit flag (KVSHARE_AUDIT is not enough: an environment variable is too easy to
    lose), so the engine stops at the first violation instead of serving wrong answers. Checked
    before the model loads, so a typo or a missing --audit fails at once rather than after the
    load (and once, not in each of N data-parallel replicas)."""
    from kvshare.testing.environment import require_testing
    from kvshare.testing.faults import FAULTS

    require_testing(f"--inject-fault {args.inject_fault}")
    unaudited = getattr(args, "inject_fault_unaudited", False)
    if unaudited and args.audit:
        raise ValueError("--inject-fault-unaudited and --audit contradict each other: pick one")
    if not args.audit and not unaudited:
        raise ValueError(f"--inject-fault {args.inject_fault} needs --audit: the planted bug corrupts the KV "
                         "cache, and only the audit stops the engine at it (a test-only option)")
    if args.inject_fault not in FAULTS:
        raise ValueError(f"--inject-fault {args.inject_fault!r} is unknown; known: {sorted(FAULTS)}")
    if unaudited:
        logging.getLogger("kvshare.server").warning(
            "--inject-fault %s --inject-fault-unaudited: this server plants a KV cache bug on purpose (a test-only "
            "option) and serves the wrong answers it causes, for `kvshare doctor --url` to find. Never use it to "
            "serve real traffic.", args.inject_fault)
        return
    logging.getLogger("kvshare.server").warning(
        "--inject-fault %s: this server plants a KV cache bug on purpose (a test-only option); the audit will "
        "stop the engine at the first violation. Never use it to serve real traffic.", args.inject_fault)


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from kvshare.config import EngineConfig
    from kvshare.errors import InvalidRequestError
    from kvshare.engine.llm_engine import LLMEngine
    from kvshare.server.async_engine import AsyncEngine
    from kvshare.server.metrics import ServerMetrics
    from kvshare.server.runner import serve
    from kvshare.server.settings import ServerConfig
    from kvshare.server.state import ServerState, default_model_name

    cfg = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name, **auth_options(args, os.environ),
        cache_salt_from_api_key=args.cache_salt_from_api_key,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        max_waiting=args.max_waiting, request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, log_prompts=args.log_prompts, access_log=not args.no_access_log,
        log_level=args.log_level, chat_template=read_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        grammar_compile_timeout=args.grammar_compile_timeout, listen_fd=args.listen_fd,
        request_body_timeout=args.request_body_timeout, limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
        max_concurrent_grammar_compiles=args.max_concurrent_grammar_compiles, max_tools_bytes=args.max_tools_bytes,
        max_chat_template_kwargs_bytes=args.max_chat_template_kwargs_bytes,
        chat_template_timeout=args.chat_template_timeout,
        max_sequences_per_request=args.max_sequences_per_request, max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length, max_stop_token_ids=args.max_stop_token_ids,
    )
    if args.inject_fault_unaudited and args.inject_fault is None:
        raise ValueError("--inject-fault-unaudited needs --inject-fault FAULT")
    if args.inject_fault is not None:
        check_inject_fault(args)
    lora_modules = check_lora_options(args)
    if args.data_parallel_size != 1:
        return serve_replicas(args, parser, cfg)
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_options(args)))
    if args.inject_fault is not None:
        from kvshare.testing.faults import plant
        plant(engine, args.inject_fault, unguarded=args.inject_fault_unaudited)
    name = cfg.served_model_name or default_model_name(args.model)
    metrics = ServerMetrics(name)
    state = ServerState(
        config=cfg, engine=AsyncEngine(engine, metrics, cfg.max_waiting, cfg.retry_after_seconds), metrics=metrics,
        model_name=name, model_source=str(engine.model_source), tokenizer=engine.tokenizer,
        max_model_len=engine.layout.max_model_len, max_num_seqs=engine.config.max_num_seqs,
        transparency_gaps=tuple(engine.transparency),
    )
    for lora_name, path in lora_modules:  # (before the engine thread starts: loaded here, in order)
        if lora_name == name:
            raise ValueError(f"--lora-modules {lora_name}={path}: '{lora_name}' is the base model's name")
        req = state.adapters.new(lora_name, path)
        try:
            engine.add_lora(req)
        except InvalidRequestError as e:
            raise ValueError(f"--lora-modules {lora_name}={path}: {e}") from None
        state.adapters.by_name[lora_name] = req
    serve(state)
    return 0


def check_lora_options(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora-modules parsed, and the LoRA flags checked against each other before the model loads."""
    from kvshare.server.lora_routes import parse_lora_modules

    modules = parse_lora_modules(args.lora_modules)
    for flag, given in (("--lora-modules", bool(modules)),
                        ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating)):
        if given and not args.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora (the engine serves no adapters without it)")
    if args.allow_runtime_lora_updating and args.data_parallel_size != 1:
        raise ValueError("--allow-runtime-lora-updating is not offered with --data-parallel-size > 1 (an adapter "
                         "loaded at run time would reach one replica only); give the adapters with --lora-modules")
    return modules


def serve_replicas(args: argparse.Namespace, parser: argparse.ArgumentParser, cfg) -> int:
    from kvshare.config import EngineConfig
    from kvshare.server.data_parallel import DataParallelOptions, new_hash_seed, serve_data_parallel

    # The engine options are checked here, once, so a bad flag is one error and not N dying replicas.
    engine_cfg = EngineConfig.from_kwargs(**engine_options(args))
    options = DataParallelOptions(
        size=args.data_parallel_size, policy=args.routing_policy, block_size=engine_cfg.block_size,
        hash_seed=args.prefix_caching_hash_seed or new_hash_seed(), kv_events_topic=args.kv_events_topic,
        kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        max_num_seqs=engine_cfg.max_num_seqs, prefix_caching=engine_cfg.enable_prefix_caching,
        lora_modules=tuple(name for name, _ in check_lora_options(args)),
    )

    # The default KV pool (a fraction of available memory) is split between the replicas, so N
    # replicas hold as much KV as one engine would; an explicit --kv-cache-memory is per replica.
    pool = {"kv_cache_memory": engine_cfg.kv_budget_bytes() // options.size} if args.kv_cache_memory is None else {}

    def argv(rank: int, port: int, publish: str, replay: str) -> list[str]:
        # The front end writes the access log (one line per client request); a replica's would
        # also list the front end's /metrics polls. The hash seed goes through the environment
        # (ReplicaLaunch.hash_seed), not here, where `ps` shows it to every user.
        return replica_argv(parser, args, {"host": "127.0.0.1", "port": port, "data_parallel_rank": rank,
                                           "kv_events_endpoint": publish,
                                           "kv_events_replay_endpoint": replay, **pool}) + ["--no-access-log"]

    return serve_data_parallel(cfg, options, argv, args.model)
