"""Structural checks on the package itself (issue 27's "checks anyone can run"). Most are read from
the source with ast and cost nothing; the type check runs mypy (seconds with its cache) and the
toy family builds a tiny model."""
from __future__ import annotations

import ast
import inspect
import io
import json
import pathlib
import re
import tokenize
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import EXACT
from kvshare import LLM, SamplingParams

PACKAGE = Path(__file__).resolve().parent.parent / "kvshare"
FAMILIES_DIR = PACKAGE / "model" / "families"


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def all_imports(tree: ast.Module):
    """Every import statement of a module: at module level, behind `if TYPE_CHECKING:` and inside
    function bodies alike (a cycle hidden behind a type-checking guard or a deferred import is still
    a cycle between the modules)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


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
        for node in all_imports(ast.parse(path.read_text(encoding="utf-8"))):
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


def test_the_cycle_finder_finds_a_cycle_hidden_behind_type_checking_or_in_a_function():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvshare.b import B\n"
                     "def f():\n    from kvshare.c import C\n")
    assert sorted(n.module for n in all_imports(tree)) == ["kvshare.b", "kvshare.c", "typing"]
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


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (`from a.b import c` counts a.b and a.b.c)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


# ---- families over one ops layer (issue 27, item 1) ---------------------------------------------
def test_no_family_imports_quantization_tensor_parallel_or_the_fused_step():
    forbidden = {"kvshare.model.qlinear", "kvshare.model.gguf_quants", "kvshare.model.kv_quant",
                 "kvshare.model.tensor_parallel", "kvshare.model.tp_transport", "kvshare.model.fused_decode",
                 "kvshare.model.kernels", "kvshare.engine.tensor_parallel"}
    files = sorted(FAMILIES_DIR.glob("*.py"))
    assert len(files) >= 3
    def banned(path):  # a forbidden module or anything inside it (kvshare.model.kernels.qmatmul)
        return sorted(m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
    bad = {f.name: banned(f) for f in files if banned(f)}
    assert not bad


def test_each_family_file_is_at_most_200_lines():
    long = {f.name: n for f in FAMILIES_DIR.glob("*.py") if (n := len(f.read_text().splitlines())) > 200}
    assert not long


def test_the_architecture_list_is_spelled_once():
    """Every registered architecture (and HF model_type) name appears as a string only under
    kvshare/model/families/. The exceptions are other names spelled alike, in the tokenizer: GGUF's
    tokenizer.ggml.model 'llama' (SentencePiece) and tokenizer.ggml.pre 'qwen2' (a pre-tokenizer)."""
    from kvshare.model.families import REGISTRY

    names = set(REGISTRY.architectures()) | set(REGISTRY.hf_model_types())
    assert {"llama", "qwen3", "phi3", "gemma3"} <= names
    spelled = {}
    for path in PACKAGE.rglob("*.py"):
        if FAMILIES_DIR in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                if path.name == "tokenizer.py" and node.value in ("llama", "qwen2"):
                    continue
                spelled.setdefault(str(path.relative_to(PACKAGE)), set()).add(node.value)
    assert not spelled
    # ...and each name is registered by exactly one family.
    assert len(REGISTRY.architectures()) == len(set(REGISTRY.architectures()))


# ---- a family registered from a test serves -----------------------------------------------------
HIDDEN, HEADS, KV_HEADS, LAYERS, INTER, VOCAB = 32, 4, 2, 2, 48, 96


def _toy_family():
    """A family kvshare does not ship: GPT-J's parallel residual (attention and MLP both read the
    layer's input) over the Llama tensor names, one RMSNorm per branch."""
    from kvshare.model import ops as O
    from kvshare.model.families import Family

    class ParallelResidualModel(O.Model):
        def build(self, weights):
            c, ops = self.config, self.ops
            self.scale = c.head_dim ** -0.5
            self.lm_head = self.embed = ops.linear(weights.pop("model.embed_tokens.weight"))
            self.norm = ops.dense(weights.pop("model.norm.weight"))
            self.layers = []
            for i in range(c.num_layers):
                p = f"model.layers.{i}."
                layer = type("Layer", (), {})()
                layer.attn_norm = ops.dense(weights.pop(p + "input_layernorm.weight"))
                layer.mlp_norm = ops.dense(weights.pop(p + "post_attention_layernorm.weight"))
                layer.qkv = ops.linear(ops.fuse([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                layer.o = ops.linear(weights.pop(p + "self_attn.o_proj.weight"))
                layer.gate_up = ops.linear(ops.fuse([weights.pop(p + "mlp.gate_proj.weight"),
                                                     weights.pop(p + "mlp.up_proj.weight")]))
                layer.down = ops.linear(weights.pop(p + "mlp.down_proj.weight"))
                self.layers.append(layer)
            self.rotary = ops.rotary(c)

        def small_weight_bytes(self):
            return 0

        def rope_tables(self, positions):
            return [self.rotary.tables(positions)]

        def layers_forward(self, ops, h, tables):
            c = self.config
            n, (cos, sin) = h.shape[0], tables[0]
            q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            for i, layer in enumerate(self.layers):
                qkv = ops.linear(layer.qkv, O.norm(h, layer.attn_norm, c.rms_norm_eps))
                q = O.rope(qkv[:, :q_size].reshape(n, c.num_heads, c.head_dim), cos, sin)
                k = O.rope(qkv[:, q_size:q_size + kv_size].reshape(n, c.num_kv_heads, c.head_dim), cos, sin)
                v = qkv[:, q_size + kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
                attn = ops.linear(layer.o, ops.attention(i, q, k, v, self.scale).reshape(n, q_size), row_parallel=True)
                gate, up = ops.linear(layer.gate_up, O.norm(h, layer.mlp_norm, c.rms_norm_eps)).chunk(2, dim=-1)
                h = h + attn + ops.linear(layer.down, F.silu(gate) * up, row_parallel=True)
            return h

        def final_norm(self, hidden):
            return O.norm(hidden, self.norm, self.config.rms_norm_eps)

    return Family("kvshare_test_parallel_residual", ParallelResidualModel,
                  hf_model_type="kvshare_test_parallel_residual",
                  hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 256, "bos_token_id": None,
                               "eos_token_id": None})


def _toy_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = HIDDEN // HEADS

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * d, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * d, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * d, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * d)
        w[p + "mlp.gate_proj.weight"] = rand(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTER)
    return w


def _toy_reference_logprobs(w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """The toy family's math written out in plain torch over the whole sequence: [T, VOCAB]."""
    d, eps, n = HIDDEN // HEADS, 1e-6, len(tokens)

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rope(x):  # [heads, T, d]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, HEADS, d).transpose(0, 1))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, KV_HEADS, d).transpose(0, 1))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, KV_HEADS, d).transpose(0, 1)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        scores = (q @ k.transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HIDDEN) @ w[p + "self_attn.o_proj.weight"].T
        m = norm(h, w[p + "post_attention_layernorm.weight"])
        mlp = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        h = h + attn + mlp
    return (norm(h, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T).log_softmax(-1)


def test_a_family_registered_from_a_test_serves(tmp_path):
    from safetensors.torch import save_file

    from kvshare.model.families import REGISTRY

    family = _toy_family()
    weights = _toy_weights()
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": family.hf_model_type, "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "tie_word_embeddings": True}))
    prompt = [3, 17, 42, 5, 77, 12, 9]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with REGISTRY.registered(family):
        llm = LLM(**EXACT, model=str(tmp_path), kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=5)
        assert type(llm.engine.model).__name__ == "ParallelResidualModel"
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert REGISTRY.get(family.architecture) is None  # the registration is undone
    ref = _toy_reference_logprobs(weights, prompt + out.token_ids)
    expected = [int(ref[len(prompt) - 1 + i].argmax()) for i in range(len(out.token_ids))]
    assert out.token_ids == expected
    got = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)])
    want = torch.stack([ref[len(prompt) - 1 + i, t] for i, t in enumerate(out.token_ids)])
    assert (got - want).abs().max() < 1e-4
    with pytest.raises(Exception, match="not supported"):
        LLM(**EXACT, model=str(tmp_path), kv_cache_memory="4MiB")


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


# Where the number of KV cache groups may be looked at: the coordinator, the planner of groups,
# and the memory planner, which predicts the coordinator's block counts (a lone windowed group
# keeps its whole table, as the coordinator does) and says how many groups share the blocks.
GROUP_AWARE = {"kvcache/coordinator.py", "kvcache/kv_groups.py", "memory_plan.py"}
# "Groups or not" and "group 0 is special", as they used to be spelled.
GROUP_BRANCHES = [
    r"GroupedKVCacheManager",
    r"\b(\w*groups|policy|policies)\s+is\s+(not\s+)?None",  # no plan of groups / no policy object
    r"\b\w*groups\[0\]",  # the first group standing for all
    r"\bif\s+(not\s+)?(self\.|engine\.)?kv_groups\b",  # truthiness of the groups list
    r"\b(group|g|gi)\s*==\s*0\b",
    r"num_groups\s*==\s*1",
    r"len\(\s*[\w.]*group\w*\s*\)\s*(>|==|<=|!=)\s*1\b",  # one group or several
    r"enumerate\([^)]*groups?\s*,\s*1\s*\)",  # groups counted from 1: group 0 held apart
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
    source = ("if kv_groups is None:\n    x = self.kv_groups[0].size\nif engine.kv_groups:\n    y = 1 if g == 0 else 2\n"
              "s = 'g' if len(group_tables) > 1 else ''\nfor g, a in enumerate(c.groups, 1):\n    pass\n")
    lines = _code_lines(source)
    assert all(any(re.search(p, code) for p in GROUP_BRANCHES) for code in lines.values() if code != "pass")
    assert len(lines) == 7
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


def _source_texts(exclude: str | None = None):
    for path in sorted(PACKAGE.rglob("*.py")):
        if exclude is None or exclude not in path.relative_to(PACKAGE).parts:
            yield path, path.read_text(encoding="utf-8")


def test_no_step_asks_whether_a_kernel_build_has_finished():
    """A kernel library is settled when the engine is built (KernelLibrary.settle); outside the
    kernels package nothing polls `available()` / `is_done()`, which change when a background
    build finishes, so no row's kernel can switch mid-run."""
    polls = re.compile(r"\b(ATTENTION|QMATMUL|DECODE|SHM|paged_attention)\.(available|is_done)\(")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path, text in _source_texts(exclude="kernels")
             for n, line in enumerate(text.splitlines(), 1) if polls.search(line)]
    assert found == []


def test_one_gguf_reader():
    """GGUF files are read by kvshare.model.gguf_header alone (not also by the gguf package's
    GGUFReader), so every check on a corrupt file is made once."""
    uses = re.compile(r"^\s*(from gguf(\.\w+)* )?import [^\n]*\bGGUFReader\b|\bgguf\.GGUFReader\b", re.M)
    found = [str(path.relative_to(PACKAGE)) for path, text in _source_texts() if uses.search(text)]
    assert found == []

ENGINE_INTERNALS = {"manager", "scheduler", "pool", "kv_cache"}


def _callers_of_the_engine() -> list[Path]:
    """The server, Ray and the doctor: they use the engine's API, never its parts."""
    files = sorted((PACKAGE / "server").rglob("*.py")) + sorted((PACKAGE / "ray").rglob("*.py"))
    return files + sorted(PACKAGE.glob("doctor*.py"))


def test_server_ray_and_doctor_read_no_engine_internals():
    found = []
    for path in _callers_of_the_engine():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
    assert len(_callers_of_the_engine()) > 10
    assert not found, "read through the engine API instead:\n" + "\n".join(found)


def _engine_members() -> set[str]:
    """Every name an LLMEngine answers to: its class's members and what its methods assign to self."""
    from kvshare.engine.llm_engine import LLMEngine

    tree = ast.parse((PACKAGE / "engine/llm_engine.py").read_text(encoding="utf-8"))
    assigned = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return assigned | {n for n in vars(LLMEngine) if not n.startswith("__")}


def _engine_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, member) for each attribute read off something called engine (`engine.x`,
    `self.engine.x`, `state.engine.engine.x`, `self.engine(...).x`, `eng.x`, `llm_engine.x`)."""
    def last_name(node: ast.AST) -> str | None:
        node = node.func if isinstance(node, ast.Call) else node
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return [(n.lineno, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and last_name(n.value) in ("engine", "eng", "llm_engine")]


def test_callers_use_only_the_declared_engine_api():
    """The server, Ray and the doctor use the members kvshare.engine.engine_api lists and nothing
    else an LLMEngine has (its core, scheduler, request records, structured-output compiler, ...)."""
    from kvshare.engine.engine_api import ENGINE_API

    own = _engine_members() - ENGINE_API
    assert {"core", "runner", "requests", "structured", "auditor", "view_tap", "kv_policy"} <= own
    assert ENGINE_API <= _engine_members(), "the API lists a member LLMEngine does not have"
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: .{name}" for path in _callers_of_the_engine()
             for line, name in _engine_reads(ast.parse(path.read_text(encoding="utf-8"))) if name in own]
    assert not found, "the engine's own parts, read by a caller (add to the engine API instead):\n" + "\n".join(found)


def test_the_engine_api_check_can_fail():
    source = "x = self.engine.engine.structured\ny = engine.view_tap.take()\nz = state.engine.step_count\n"
    own = _engine_members() - {"step_count"}
    assert [(line, name) for line, name in _engine_reads(ast.parse(source)) if name in own] == \
        [(1, "structured"), (2, "view_tap")]


def test_engine_and_model_runner_modules_are_at_most_300_lines():
    for name in ("llm_engine.py", "model_runner.py"):
        lines = len((PACKAGE / "engine" / name).read_text(encoding="utf-8").splitlines())
        assert lines <= 300, f"kvshare/engine/{name} has {lines} lines"
