"""Structural checks anyone can run (issue 27): each reads the source, no model, no engine."""
from __future__ import annotations

import ast
import inspect
import io
import pathlib
import re
import tokenize

import kvshare

PACKAGE = pathlib.Path(kvshare.__file__).parent


def _modules(folder: pathlib.Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_kv_core_imports_no_torch():
    offenders = {str(path.relative_to(PACKAGE)): sorted(n for n in _imported(tree) if n.split(".")[0] == "torch")
                 for path, tree in _modules(PACKAGE / "kvcache")}
    assert {p: n for p, n in offenders.items() if n} == {}


# Where the number of KV cache groups may be looked at: the coordinator and the planner of groups.
GROUP_AWARE = {"kvcache/coordinator.py", "kvcache/kv_groups.py"}
# "Groups or not" and "group 0 is special", as they used to be spelled.
GROUP_BRANCHES = [
    r"GroupedKVCacheManager",
    r"\b(\w*groups|policy|policies)\s+is\s+(not\s+)?None",  # no plan of groups / no policy object
    r"\b\w*groups\[0\]",  # the first group standing for all
    r"\bif\s+(not\s+)?(self\.|engine\.)?kv_groups\b",  # truthiness of the groups list
    r"\b(group|g|gi)\s*==\s*0\b",
    r"num_groups\s*==\s*1",
]


def _code_lines(source: str) -> dict[int, str]:
    """Line number -> the line's code, with strings and comments blanked out (non-empty lines only)."""
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for row in range(r0, r1 + 1):
                line = lines[row - 1]
                start, end = (c0 if row == r0 else 0), (c1 if row == r1 else len(line))
                lines[row - 1] = line[:start] + " " * (end - start) + line[end:]
    return {n: line.strip() for n, line in enumerate(lines, 1) if line.strip()}


def test_nothing_outside_the_coordinator_branches_on_groups_or_group_0():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel in GROUP_AWARE:
            continue
        for lineno, code in _code_lines(path.read_text()).items():
            found += [f"{rel}:{lineno}: {code}" for pattern in GROUP_BRANCHES if re.search(pattern, code)]
    assert found == []


def test_the_check_above_can_fail():
    source = "if kv_groups is None:\n    x = self.kv_groups[0].size\nif engine.kv_groups:\n    y = 1 if g == 0 else 2\n"
    lines = _code_lines(source)
    assert all(any(re.search(p, code) for p in GROUP_BRANCHES) for code in lines.values()) and len(lines) == 4
    assert _code_lines('x = "groups[0]"  # if g == 0') == {1: "x ="}


def _line_count(rel: str) -> int:
    return len((PACKAGE / rel).read_text().splitlines())


def test_the_per_group_manager_and_the_scheduler_stay_small():
    assert {rel: _line_count(rel) for rel in ("kvcache/manager.py", "engine/scheduler.py")
            if _line_count(rel) > 300} == {}


def _protocol_members(proto) -> set[str]:
    return {name for name in vars(proto) if not name.startswith("_")}


def test_the_coordinator_provides_the_kv_core_interface():
    from kvshare.kvcache.coordinator import KVCacheCoordinator
    from kvshare.kvcache.interface import KVCore
    from kvshare.kvcache.kv_groups import plan_kv_groups

    members = _protocol_members(KVCore)
    assert members, "KVCore declares nothing"
    core = KVCacheCoordinator(4, 4, plan_kv_groups([None, 8], 4))
    for name in sorted(members):
        declared = inspect.getattr_static(KVCore, name)
        assert hasattr(core, name), f"KVCacheCoordinator lacks {name}"
        if inspect.isfunction(declared):
            params = list(inspect.signature(declared).parameters)[1:]  # without self
            assert list(inspect.signature(getattr(core, name)).parameters) == params, name
        else:
            assert isinstance(declared, property), name


def test_the_scheduler_uses_only_the_kv_core_interface():
    """Every `self.manager.X` / `mgr.X` the scheduler reads is declared by KVCore, and every member
    KVCore declares for the scheduler is used by it or by the engine (the interface stays small)."""
    from kvshare.kvcache.interface import KVCore

    tree = ast.parse((PACKAGE / "engine/scheduler.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "mgr") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "manager"):
                used.add(node.attr)
    members = _protocol_members(KVCore)
    assert used - members == set()
    engine_side = {"events", "tables", "pool", "num_used_blocks"}
    assert members - used - engine_side == set()
