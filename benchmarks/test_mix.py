"""How much of the test suite is model-free: test lines per file and in total, by what they load.

    python benchmarks/test_mix.py                 # the table, from the source (instant)
    python benchmarks/test_mix.py --verify tests/test_x.py ...
                                                  # run those files under pytest, record what each
                                                  # test really loaded, and list every test whose
                                                  # recorded kind differs from the static one
    python benchmarks/test_mix.py --verify-free tests/test_x.py ...
                                                  # the same, running only the tests counted as
                                                  # model-free or model-file (the cheap check)

Definitions (one per test; a test is a `test_*` function or method in tests/test_*.py):
- model: the test builds an engine (`LLM`, `LLMEngine`, `AsyncEngine`), loads model weights
  (`load_model`, a transformers `*ForCausalLM`, `tests/helpers.py`'s `tiny_model` /
  `hf_reference`), or starts a `kvshare` process (`ServerProcess`, Ray's `build_app`, the
  `TensorParallelLauncher`, a replica's `REPLICA_BOOT`, a `subprocess` call whose strings start
  `kvshare.cli` or a TP worker or build an `LLM`: a served model, a CLI run that may load one).
  Reading a model file's tensors (`dequantize_tensor`, a tensor's `.data`) is loading weights,
  and `kvshare.cli`'s `main` run in-process counts as a kvshare process.
- model-file: none of that, but it reads a model file's metadata: the bundled GGUF's (or
  Gemma's) tokenizer (`Tokenizer.from_gguf_metadata` / `from_file`, `load_tokenizer`,
  `hf_tokenizer`) or header (`bundled_path`, `bundled_model_path`, `packaged_model_path`,
  `open_gguf_file`, `read_gguf_header`, `resolve_model_path`, `load_arch_config`, `kvshare
  memory`). No weights and no engine, but it needs the model package installed and costs a file
  parse. (Statically these names count whatever path they are given, so a test reading a file it
  wrote itself counts here too: the share errs low.)
- model-free: neither. This is the headline share; model-file tests are NOT counted in it.

A test's kind is the strongest kind among the names it reaches: its own body, the module's helpers,
classes and fixtures it uses (by name, parameters resolved as fixtures in the class, the module,
then tests/conftest.py), in-module autouse fixtures, and the helpers it imports from tests/*.py,
followed transitively. kvshare's own functions are not followed: a test reaching the model only
through some other kvshare entry point would be missed, which is what `--verify` is for (it
patches the weight loader, the engine's constructor, the tokenizer readers and subprocess spawns
and records, per test and per fixture, what was really called).

Test lines are physical lines of tests/test_*.py, so the total is `wc -l tests/test_*.py`:
- a test's lines (decorators included) count for its kind;
- a helper, fixture or helper class counts as model-free only if every test that uses it is
  model-free (else as the strongest kind among its users; an unused one by what it reaches);
- the rest of a module (docstring, imports, constants, blank lines between definitions) is split
  among the kinds in proportion to the module's other lines.
The last line also gives the coarser count by whole file (files in which no test loads anything),
which is lower: a file of server tests with a few model-free ones counts as model there.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

KINDS = ("model-free", "model-file", "model")
FREE, FILE, MODEL = range(3)

MODEL_NAMES = {
    "LLM", "LLMEngine", "AsyncEngine", "load_model", "ServerProcess", "tiny_model", "hf_reference",
    "AutoModelForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "build_app",  # kvshare.ray: a Serve application whose replicas build engines
    "TensorParallelLauncher",  # starts the engine's tensor-parallel worker processes
    "REPLICA_BOOT",  # a data-parallel replica's boot code: a `kvshare serve` process
}
FILE_NAMES = {
    "from_gguf_metadata", "from_file", "load_tokenizer", "hf_tokenizer", "bundled_path",
    "bundled_model_path", "packaged_model_path", "bundled_dir", "open_gguf_file", "read_gguf_header",
    "resolve_model_path", "load_arch_config", "PACKAGED_MODELS",
}
# Reading a model file's tensors is loading weights: these names, with a model file reached.
WEIGHT_NAMES = {"dequantize_tensor", "to_group_affine", "data"}
# In-process command lines: `kvshare` itself may build an engine; `kvshare memory` reads a header.
CLI_MODULES = {"kvshare.cli": MODEL, "kvshare.__main__": MODEL, "kvshare.memory_cli": FILE}
MODEL_IN_STRING = re.compile(r"kvshare\.cli|kvshare\.engine\.tp_worker|\b(LLM|LLMEngine|load_model)\b")
SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}


@dataclass
class Definition:
    """A top-level function, class or fixture of a tests/ module (or a method of a test class)."""
    module: str
    name: str
    first: int
    last: int
    names: set[str] = field(default_factory=set)  # identifiers it mentions
    params: list[str] = field(default_factory=list)  # fixture requests
    own_kind: int = FREE
    spawns: bool = False  # starts a process (subprocess.run / Popen ...)
    strings: list[str] = field(default_factory=list)
    is_test: bool = False
    autouse: bool = False
    owner: "Definition | None" = None  # the test class of a method
    members: dict[str, "Definition"] = field(default_factory=dict)  # a class's methods / fixtures


def _is_fixture(node: ast.AST) -> tuple[bool, bool, str | None]:
    """(is a pytest fixture, autouse, its name= if given)."""
    for dec in getattr(node, "decorator_list", []):
        call = dec if isinstance(dec, ast.Call) else None
        target = call.func if call else dec
        text = ast.unparse(target)
        if text.endswith("fixture"):
            autouse, name = False, None
            for kw in call.keywords if call else []:
                if kw.arg == "autouse" and isinstance(kw.value, ast.Constant):
                    autouse = bool(kw.value.value)
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    name = kw.value.value
            return True, autouse, name
    return False, False, None


def _scan(node: ast.AST, d: Definition) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            d.names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            d.names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            d.strings.append(sub.value)
        elif isinstance(sub, ast.ImportFrom) and sub.module in CLI_MODULES:
            if any(alias.name == "main" for alias in sub.names):
                d.own_kind = max(d.own_kind, CLI_MODULES[sub.module])
        elif isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in SUBPROCESS_CALLS and ast.unparse(func.value) == "subprocess":
                d.spawns = True
            elif isinstance(func, ast.Name) and func.id == "Popen":
                d.spawns = True
    if d.names & MODEL_NAMES:
        d.own_kind = MODEL
    elif d.names & FILE_NAMES:
        d.own_kind = max(d.own_kind, FILE)


def _definition(module: str, node: ast.AST, owner: Definition | None = None, name: str | None = None) -> Definition:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    d = Definition(module, name or node.name, first, node.end_lineno, owner=owner)
    _scan(node, d)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        d.params = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
        d.is_test = node.name.startswith("test")
    return d


@dataclass
class Module:
    name: str
    path: str
    lines: int
    defs: dict[str, Definition] = field(default_factory=dict)
    fixtures: dict[str, Definition] = field(default_factory=dict)
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    tests: list[Definition] = field(default_factory=list)


def parse_module(path: str) -> Module:
    tests_dir = os.path.dirname(path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    mod = Module(os.path.splitext(os.path.basename(path))[0], path, len(source.splitlines()))
    local_modules = {os.path.splitext(n)[0] for n in os.listdir(tests_dir) if n.endswith(".py")}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in CLI_MODULES:
            for alias in node.names:
                if alias.name == "main":
                    cli = Definition(mod.name, alias.asname or "main", node.lineno, node.end_lineno,
                                     own_kind=CLI_MODULES[node.module])
                    mod.defs[cli.name] = cli
        if isinstance(node, ast.ImportFrom) and node.module in local_modules:
            for alias in node.names:
                mod.imported[alias.asname or alias.name] = (node.module, alias.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            d = _definition(mod.name, node)
            fixture, d.autouse, fixture_name = _is_fixture(node)
            mod.defs[node.name] = d
            if fixture:
                d.is_test = False
                mod.fixtures[fixture_name or node.name] = d
            elif d.is_test:
                mod.tests.append(d)
        elif isinstance(node, ast.ClassDef):
            cls = _definition(mod.name, node)
            mod.defs[node.name] = cls
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    m = _definition(mod.name, item, owner=cls)
                    fixture, m.autouse, fixture_name = _is_fixture(item)
                    if fixture:
                        m.is_test = False
                        cls.members[fixture_name or item.name] = m
                    elif m.is_test and node.name.startswith("Test"):
                        mod.tests.append(m)
                    else:
                        m.is_test = False
                        cls.members[item.name] = m
            # The class's own kind, for a helper class used by name: its non-test members only.
            cls.own_kind = max([m.own_kind for m in cls.members.values()] + [FREE])
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            # A module constant (a command line, a code string) is followed like a helper.
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        mod.defs.setdefault(sub.id, _definition(mod.name, node, name=sub.id))
    return mod


class Suite:
    def __init__(self, tests_dir: str = TESTS) -> None:
        self.tests_dir = tests_dir
        self.modules = {}
        for name in sorted(os.listdir(tests_dir)):
            if name.endswith(".py"):
                mod = parse_module(os.path.join(tests_dir, name))
                self.modules[mod.name] = mod
        self.conftest = self.modules.get("conftest")

    def _resolve(self, mod: Module, name: str, owner: Definition | None) -> Definition | None:
        if owner is not None and name in owner.members:
            return owner.members[name]
        if name in mod.defs:
            return mod.defs[name]
        if name in mod.imported:
            other, real = mod.imported[name]
            return self.modules[other].defs.get(real) if other in self.modules else None
        return None

    def _resolve_fixture(self, mod: Module, name: str, owner: Definition | None) -> Definition | None:
        if owner is not None and name in owner.members:
            return owner.members[name]
        if name in mod.fixtures:
            return mod.fixtures[name]
        if self.conftest and name in self.conftest.fixtures:
            return self.conftest.fixtures[name]
        return None

    def reach(self, d: Definition) -> tuple[int, list[Definition]]:
        """(the strongest kind reachable from d, the definitions it uses)."""
        seen: dict[int, Definition] = {}
        stack = [d]
        mod0 = self.modules[d.module]
        # Autouse fixtures of the test's own module (and class) apply to it; conftest's do not load
        # anything by themselves (the load cache only wraps load_model).
        if d.is_test:
            stack += [f for f in mod0.fixtures.values() if f.autouse]
            if d.owner:
                stack += [m for m in d.owner.members.values() if m.autouse]
        kind = FREE
        spawns, strings, names = False, [], set()
        while stack:
            cur = stack.pop()
            if id(cur) in seen:
                continue
            seen[id(cur)] = cur
            kind = max(kind, cur.own_kind)
            spawns |= cur.spawns
            strings += cur.strings
            names |= cur.names
            mod = self.modules[cur.module]
            owner = cur.owner if cur.owner else (cur if cur.members else None)
            for name in cur.names:
                target = self._resolve(mod, name, owner)
                if target is not None:
                    stack.append(target)
            for name in cur.params:
                target = self._resolve_fixture(mod, name, owner)
                if target is not None:
                    stack.append(target)
            if cur.members:  # a class used by name: its methods
                stack += list(cur.members.values())
        # A spawned process is a model one when the strings it reaches start kvshare or build one.
        if spawns and any(MODEL_IN_STRING.search(text) for text in strings):
            kind = MODEL
        if kind == FILE and names & WEIGHT_NAMES:
            kind = MODEL
        used = [u for u in seen.values() if u is not d]
        return kind, used

    def classify(self) -> tuple[dict[str, list[float]], dict[tuple[str, str], int]]:
        """Per test file, lines of each kind; and each test's kind keyed by (file, Class::name)."""
        test_kinds: dict[tuple[str, str], int] = {}
        users: dict[int, list[int]] = defaultdict(list)  # id(definition) -> kinds of tests using it
        for mod in self.modules.values():
            if not mod.name.startswith("test_"):
                continue
            for t in mod.tests:
                kind, used = self.reach(t)
                test_kinds[(mod.name, (t.owner.name + "::" if t.owner else "") + t.name)] = kind
                for u in used:
                    users[id(u)].append(kind)
        table: dict[str, list[float]] = {}
        for mod in self.modules.values():
            if not mod.name.startswith("test_"):
                continue
            counts = [0.0, 0.0, 0.0]
            covered = 0
            spans: list[tuple[Definition, int]] = []
            for t in mod.tests:
                spans.append((t, test_kinds[(mod.name, (t.owner.name + "::" if t.owner else "") + t.name)]))
            for d in mod.defs.values():
                if d.is_test:
                    continue
                if d.members or any(t.owner is d for t in mod.tests):
                    # A class: its non-test members, and its own header and body lines left over.
                    for m in d.members.values():
                        spans.append((m, self._shared_kind(m, users)))
                    test_lines = sum(t.last - t.first + 1 for t in mod.tests if t.owner is d)
                    member_lines = sum(m.last - m.first + 1 for m in d.members.values())
                    rest = (d.last - d.first + 1) - test_lines - member_lines
                    class_kinds = [test_kinds[(mod.name, d.name + "::" + t.name)] for t in mod.tests if t.owner is d]
                    counts[max(class_kinds + [FREE]) if class_kinds else self._shared_kind(d, users)] += rest
                    covered += rest
                else:
                    spans.append((d, self._shared_kind(d, users)))
            for d, kind in spans:
                n = d.last - d.first + 1
                counts[kind] += n
                covered += n
            rest = mod.lines - covered
            attributed = sum(counts)
            for k in range(3):
                counts[k] += rest * (counts[k] / attributed) if attributed else (rest if k == FREE else 0)
            table[mod.name] = counts
        return table, test_kinds

    def _shared_kind(self, d: Definition, users: dict[int, list[int]]) -> int:
        kinds = users.get(id(d))
        if kinds:
            return max(kinds)
        return self.reach(d)[0]


def report(table: dict[str, list[float]]) -> None:
    print(f"{'file':40s} {'lines':>6s} {'free':>6s} {'file':>6s} {'model':>6s}  free%")
    totals = [0.0, 0.0, 0.0]
    for name, counts in sorted(table.items()):
        total = sum(counts)
        totals = [a + b for a, b in zip(totals, counts)]
        print(f"{name + '.py':40s} {total:6.0f} {counts[FREE]:6.0f} {counts[FILE]:6.0f} {counts[MODEL]:6.0f}"
              f"  {100 * counts[FREE] / total if total else 0:5.1f}")
    total = sum(totals)
    print(f"{'TOTAL':40s} {total:6.0f} {totals[FREE]:6.0f} {totals[FILE]:6.0f} {totals[MODEL]:6.0f}"
          f"  {100 * totals[FREE] / total:5.1f}")
    print(f"model-free: {100 * totals[FREE] / total:.1f}% of test lines "
          f"(model-free or model-file: {100 * (totals[FREE] + totals[FILE]) / total:.1f}%)")
    # The coarser count, by whole file: the lines of files in which no test loads anything.
    whole = sum(sum(c) for c in table.values() if c[FILE] == c[MODEL] == 0)
    print(f"files with only model-free tests: {100 * whole / total:.1f}% of test lines")


# --- --verify: a pytest plugin recording what each test really loaded -------------------------

_RECORD_ENV = "KVSHARE_TEST_MIX_RECORD"
# tests/conftest.py's autouse fixture finds the model files to cache their loads: it loads nothing
# itself (the static measure skips conftest's autouse fixtures for the same reason).
SETUP_ONLY_FIXTURES = {"load_real_models_once"}


class _Recorder:
    """Patched entry points note their kind against the test (or fixture) being set up or run."""

    def __init__(self) -> None:
        self.current: list[str] = []
        self.seen: dict[str, int] = defaultdict(int)
        self.muted = 0

    def note(self, kind: int) -> None:
        if self.muted:
            return
        for key in self.current:
            self.seen[key] = max(self.seen[key], kind)


def _install(recorder: _Recorder) -> None:
    import functools

    from kvshare.engine import llm_engine
    from kvshare.model import loader, tokenizer

    real_files = _real_model_files(loader)

    def wrap(owner, attr, kind, counts=lambda args: True):
        """Patch owner.attr, and every kvshare module that imported that same function by name."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        def patched(*args, **kwargs):
            if counts(args):
                recorder.note(kind)
            return original(*args, **kwargs)

        for name, module in list(sys.modules.items()):
            if (name.startswith("kvshare") or module is owner) and getattr(module, attr, None) is original:
                setattr(module, attr, patched)

    wrap(loader, "load_model", MODEL)
    original_init = llm_engine.LLMEngine.__init__

    def engine_init(self, *args, **kwargs):
        recorder.note(MODEL)
        return original_init(self, *args, **kwargs)

    llm_engine.LLMEngine.__init__ = engine_init
    for attr in ("from_gguf_metadata", "from_file"):
        original = getattr(tokenizer.Tokenizer, attr)

        def reader(*args, __original=original, **kwargs):
            recorder.note(FILE)
            return __original(*args, **kwargs)

        setattr(tokenizer.Tokenizer, attr, staticmethod(reader))
    wrap(loader, "load_tokenizer", FILE)
    wrap(loader, "bundled_model_path", FILE)
    wrap(loader, "packaged_model_path", FILE)
    import kvshare.memory_plan  # noqa: F401 (imports the header reader by name: patched there too)
    from kvshare.model import gguf_header, gguf_loader

    # A GGUF the test wrote itself (random blocks) is not a model file.
    wrap(gguf_header, "open_gguf_file", FILE, lambda args: os.path.realpath(args[0]) in real_files)
    wrap(gguf_header, "read_gguf_header", FILE, lambda args: os.path.realpath(args[0]) in real_files)
    wrap(gguf_loader, "dequantize_tensor", MODEL, lambda args: _mapped_from(args[0], real_files))
    popen_init = subprocess.Popen.__init__

    def spawn(self, args, *rest, **kwargs):
        # As statically: a process is a model one when its command line starts kvshare or builds one.
        if MODEL_IN_STRING.search(" ".join(map(str, args if isinstance(args, (list, tuple)) else [args]))):
            recorder.note(MODEL)
        return popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = spawn
    try:
        import transformers

        model_init = transformers.PreTrainedModel.__init__

        def hf_model(self, *args, **kwargs):
            recorder.note(MODEL)
            return model_init(self, *args, **kwargs)

        transformers.PreTrainedModel.__init__ = hf_model
    except ImportError:
        pass


def _real_model_files(loader) -> set[str]:
    files = {os.path.realpath(loader.bundled_model_path())}
    try:
        files.add(os.path.realpath(loader.packaged_model_path("gemma3-270m")))
    except Exception:  # not assembled here
        pass
    return files


def _mapped_from(tensor, files: set[str]) -> bool:
    """Whether a GGUF tensor's bytes are a view of one of `files` (np.memmap keeps the name)."""
    obj = getattr(tensor, "data", None)
    while obj is not None:
        name = getattr(obj, "filename", None)
        if name:
            return os.path.realpath(name) in files
        obj = getattr(obj, "base", None)
    return False


class VerifyPlugin:
    def __init__(self, out_path: str) -> None:
        self.recorder = _Recorder()
        self.out_path = out_path
        self.fixture_kinds: dict[str, int] = defaultdict(int)
        self.test_fixtures: dict[str, list[str]] = {}
        _install(self.recorder)

    import pytest as _pytest

    @_pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.argname in SETUP_ONLY_FIXTURES:
            self.recorder.muted += 1
            try:
                yield
            finally:
                self.recorder.muted -= 1
            return
        key = f"fixture:{fixturedef.baseid}:{fixturedef.argname}"
        self.recorder.current.append(key)
        try:
            yield
        finally:
            self.recorder.current.remove(key)
            self.fixture_kinds[key] = max(self.fixture_kinds[key], self.recorder.seen.get(key, FREE))

    @_pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.recorder.current.append(item.nodeid)
        self.test_fixtures[item.nodeid] = list(item.fixturenames)
        try:
            yield
        finally:
            self.recorder.current.remove(item.nodeid)

    def pytest_sessionfinish(self, session):
        with open(self.out_path, "w", encoding="utf-8") as f:
            for nodeid, fixtures in self.test_fixtures.items():
                kind = self.recorder.seen.get(nodeid, FREE)
                for key, fkind in self.fixture_kinds.items():
                    if key.rsplit(":", 1)[1] in fixtures and fixtures and fkind:
                        base = key.split(":")[1]
                        if nodeid.startswith(base) or base in ("", "tests"):
                            kind = max(kind, fkind)
                f.write(f"{kind}\t{nodeid}\n")


def pytest_configure(config):
    """Active only under --verify (the environment variable names the output file)."""
    out = os.environ.get(_RECORD_ENV)
    if out:
        config.pluginmanager.register(VerifyPlugin(out), "kvshare-test-mix")


def verify(files: list[str], static: dict[tuple[str, str], int], pytest_args: list[str]) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".tsv") as out:
        env = dict(os.environ, **{_RECORD_ENV: out.name})
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), ROOT,
                                             env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "test_mix", *pytest_args, *files]
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        rows = [line.rstrip("\n").split("\t", 1) for line in out if line.strip()]
    mismatches = 0
    dynamic: dict[tuple[str, str], int] = {}
    for kind, nodeid in rows:
        path, _, rest = nodeid.partition("::")
        key = (os.path.splitext(os.path.basename(path))[0], re.sub(r"\[.*\]$", "", rest))
        dynamic[key] = max(dynamic.get(key, FREE), int(kind))
    for key, kind in sorted(dynamic.items()):
        expected = static.get(key)
        if expected is None:
            print(f"not found statically: {key}")
            mismatches += 1
        elif expected < kind:
            # Static under-counts: the measure would be wrong. Over-counting (static says model,
            # the run loaded nothing, e.g. a skipped test) only makes the share conservative.
            print(f"UNDER-COUNTED {key[0]}::{key[1]}: static {KINDS[expected]}, ran {KINDS[kind]}")
            mismatches += 1
        elif expected > kind:
            print(f"over-counted  {key[0]}::{key[1]}: static {KINDS[expected]}, ran {KINDS[kind]}")
    print(f"{len(dynamic)} tests recorded, {mismatches} under-counted by the static measure (pytest rc {rc})")
    return 1 if mismatches else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verify", nargs="+", metavar="TEST_FILE",
                    help="run these test files and check the static kinds against what was loaded")
    ap.add_argument("--verify-free", nargs="+", metavar="TEST_FILE",
                    help="as --verify, running only the tests the static measure counts as model-free or model-file")
    ap.add_argument("--pytest-arg", action="append", default=[], help="passed to pytest under --verify")
    ap.add_argument("--tests", action="store_true", help="list each test's kind")
    ap.add_argument("--tests-dir", default=TESTS, help="measure another checkout's tests/ (e.g. main's)")
    args = ap.parse_args()
    table, kinds = Suite(os.path.abspath(args.tests_dir)).classify()
    if args.verify:
        return verify(args.verify, kinds, args.pytest_arg)
    if args.verify_free:
        wanted = {os.path.splitext(os.path.basename(f))[0]: f for f in args.verify_free}
        nodeids = [f"{wanted[mod]}::{name}" for (mod, name), kind in sorted(kinds.items())
                   if mod in wanted and kind < MODEL]
        return verify(nodeids, kinds, args.pytest_arg)
    if args.tests:
        for (mod, name), kind in sorted(kinds.items()):
            print(f"{KINDS[kind]:11s} {mod}::{name}")
    report(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
