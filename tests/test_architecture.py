"""Structural checks on the package itself (issue 27's "checks anyone can run"): model-free, read
from the source with ast, so they cost nothing at test time."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvshare"


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def module_level_imports(tree: ast.Module):
    """Import statements that run when the module loads or that a type checker follows: everything
    outside function bodies, `if TYPE_CHECKING:` blocks included (a cycle hidden behind one is
    still a cycle between the modules)."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()

    def owner(name: str) -> str | None:  # the deepest package module a dotted name lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets.update(owner(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_hidden_behind_type_checking():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvshare.b import B\n"
                     "def f():\n    from kvshare.c import C\n")
    assert sorted(n.module for n in module_level_imports(tree)) == ["kvshare.b", "typing"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "kvshare.server.data_parallel" in graph and graph["kvshare.server.dp_proxy"]  # the graph is real
    assert cycles(graph) == []


def test_each_engine_option_is_declared_once(monkeypatch):
    """EngineConfig's fields (kvshare/config.py) are the one declaration of the engine options:
    each says whether it has a flag, and the argparse flags, their defaults, the keyword arguments
    the CLI hands EngineConfig and Ray's engine options are all read from them."""
    import argparse
    import dataclasses

    from kvshare.config import HASH_SEED_ENV, EngineConfig
    from kvshare.engine_args import RETIRED_NO_TOKEN_IDS, add_engine_args, engine_options, flag_dest, flagged_options
    from kvshare.ray.options import ENGINE_OPTIONS, REPLICA_SET

    declared = dataclasses.fields(EngineConfig)
    assert all("flag" in f.metadata for f in declared)  # every option decided: a flag, or None for none
    monkeypatch.delenv(HASH_SEED_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = [a.dest for a in parser._actions if a.option_strings and a.dest != "help"]
    expected = [flag_dest(f, flag) for f, flag in flagged_options()]
    expected.insert(expected.index("kv_events_token_ids") + 1, RETIRED_NO_TOKEN_IDS[2:].replace("-", "_"))
    assert dests == expected
    options = engine_options(parser.parse_args([]))
    for f, flag in flagged_options():
        assert options.get(f.name, f.default) == f.default, f.name  # each default written once, in EngineConfig
    assert EngineConfig(**options) == EngineConfig()
    assert set(ENGINE_OPTIONS) | REPLICA_SET == {f.name for f in declared} and not set(ENGINE_OPTIONS) & REPLICA_SET

    # The CLI module spells no engine flag of its own (only the retired one, which sets no option).
    source = (PACKAGE / "engine_args.py").read_text(encoding="utf-8")
    flags = {n.value for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"--[a-z][a-z0-9-]*", n.value)}
    assert flags == {RETIRED_NO_TOKEN_IDS}


def test_serve_flags_take_server_config_defaults():
    """`kvshare serve`'s server flags default to ServerConfig's own defaults (read from it, not
    written again): for every flag that names a ServerConfig field, the two agree."""
    import dataclasses

    from kvshare.cli import build_parser
    from kvshare.config import parse_bytes
    from kvshare.server.settings import ServerConfig

    declared = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.default is not dataclasses.MISSING}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    checked = 0
    for action in serve._actions:
        if action.dest in declared:
            default = action.default
            if action.dest.endswith("_bytes"):
                default = parse_bytes(default, action.dest)
            assert default == declared[action.dest], action.dest
            checked += 1
    assert checked >= 20


def test_events_name_the_block_log_only():
    """One word per meaning: "events" is the block log (kvshare/kvcache/events.py) and what relays
    it to the live view; what routers are told of cached prefixes (vLLM's "KV cache events") is
    called prefix updates. No other module or class says "event"."""
    modules = {name for name in package_modules() if "event" in name.rpartition(".")[2]}
    assert modules == {"kvshare.kvcache.events"}
    classes = set()
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and "event" in node.name.lower():
                classes.add(f"{name}.{node.name}")
    # The block log and its null form, and the view's fan-out of block events (redacted).
    assert classes == {"kvshare.kvcache.events.EventLog", "kvshare.kvcache.events.NullEventLog",
                       "kvshare.server.kv_stream.EventRedactor", "kvshare.server.kv_stream.KVEventHub"}


def test_type_check_passes_on_kvcache_and_engine(monkeypatch):
    """mypy, pinned in the `test` extra, with pyproject.toml's [tool.mypy] (the files, and the few
    modules without stubs): zero errors. Not an ast read: a cold run costs tens of seconds of CPU,
    its cache (.mypy_cache in the checkout, git-ignored) brings a later one to a few."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed: `pip install -e '.[test]'` pins it")
    from mypy.version import __version__ as mypy_version

    root = PACKAGE.parent
    monkeypatch.chdir(root)  # the config's `files` and the cache are relative to the checkout
    stdout, stderr, status = api.run(["--config-file", str(root / "pyproject.toml")])
    assert status == 0, f"mypy {mypy_version} (pyproject.toml pins the version this must pass on):\n{stdout}{stderr}"
