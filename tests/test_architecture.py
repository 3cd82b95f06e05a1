"""Structural checks of issue 27 anyone can run: what the package's shape must stay."""
from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

from helpers import EXACT
from kvshare import LLM, SamplingParams

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvshare"
FAMILIES_DIR = PACKAGE / "model" / "families"


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
                 "kvshare.model.cpu_kernels", "kvshare.engine.tensor_parallel"}
    files = sorted(FAMILIES_DIR.glob("*.py"))
    assert len(files) >= 3
    bad = {f.name: sorted(_imports(f) & forbidden) for f in files if _imports(f) & forbidden}
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
