"""`kvshare memory`: the planner's figures against hand computations, its errors, and the CLI.

No weights are loaded: shapes come from the bundled GGUF's header or a config.json."""
from __future__ import annotations

import json

import pytest

from kvshare.cli import main
from kvshare.memory_plan import (
    PlanConfig, attention_variants, blocks_per_request, kv_pool_blocks, load_arch_config, plan_memory,
)

GIB = 2**30
LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float16",
}
# Parameters by hand: embeddings and lm_head, final norm, 32 x (2 norms, q/k/v/o, gate/up/down).
PARAMS_7B = 32000 * 4096 * 2 + 4096 + 32 * (2 * 4096 + 4 * 4096 * 4096 + 3 * 4096 * 11008)
# GQA with 8 KV heads: k_proj and v_proj shrink from 4096 to 8 x 128 = 1024 output rows.
PARAMS_7B_GQA8 = PARAMS_7B - 32 * 2 * (4096 - 1024) * 4096


def _write_config(tmp_path, **overrides):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_7B, **overrides}))
    return str(path)


def _activations(b, hidden, q, kv, inter, vocab, max_len, tokens=2048, rows=128):
    return b * tokens * (3 * hidden + q + 2 * kv + 3 * inter) + 2 * b * kv * max_len + 4 * 3 * rows * vocab


def test_bundled_model_by_hand():
    arch, _ = load_arch_config(None)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    plan = plan_memory(arch, PlanConfig(memory="2GiB", dtype="float32"))
    s = plan.plan
    # Tied embeddings: 49152 x 576 once; per layer 2 norms, q (576x576), k and v (192x576), o, MLP (3 x 1536x576).
    params = 49152 * 576 + 576 + 30 * (2 * 576 + 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    assert plan.num_parameters == params == 134_515_008
    assert s.weight_bytes == params * 4
    assert s.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert "2 x 30 layers x 3 kv_heads x 64 head_dim x 4 bytes" in s.kv_formula
    act = _activations(4, 576, 576, 192, 1536, 49152, 8192)
    assert s.activation_bytes == act
    usable = int(2 * GIB * 0.9)
    assert s.kv_budget_bytes == usable - params * 4 - act
    blocks = (usable - params * 4 - act) // (46_080 * 16)
    assert s.num_blocks == blocks and s.token_slots == blocks * 16 and s.kv_pool_bytes == blocks * 16 * 46_080
    assert plan.max_model_len == 8192
    assert s.max_seqs_at_max_len == blocks // 512  # 8192 / 16
    assert (plan.avg_prompt_len, plan.avg_output_len) == (512, 256)
    assert s.max_requests_at_avg == s.max_seqs_at_avg == blocks // 48  # (512 + 256) / 16
    # Side by side: MHA (9 kv heads), the model's GQA (3), MQA (1).
    assert [(v.label, v.num_kv_heads, v.kv_bytes_per_token) for v in plan.variants] == [
        ("MHA", 9, 2 * 30 * 9 * 64 * 4), ("GQA (model)", 3, 46_080), ("MQA", 1, 2 * 30 * 1 * 64 * 4)]
    assert plan.variants[1].num_blocks == blocks


def test_bundled_model_quantized_and_bf16_bytes_per_token():
    arch, _ = load_arch_config(None)
    bf16 = plan_memory(arch, PlanConfig(memory="2GiB", dtype="bfloat16")).plan
    int8 = plan_memory(arch, PlanConfig(memory="2GiB", dtype="bfloat16", kv_dtype="int8")).plan
    fp8 = plan_memory(arch, PlanConfig(memory="2GiB", dtype="bfloat16", kv_dtype="fp8_e4m3")).plan
    assert bf16.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    # One byte per element plus one float32 scale per (layer, K/V, head, token).
    assert int8.kv_bytes_per_token == fp8.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12_240
    assert int8.num_blocks == int8.kv_budget_bytes // (12_240 * 16)
    assert int8.num_blocks > 1.8 * bf16.num_blocks


def test_7b_mha_by_hand(tmp_path):
    arch, _ = load_arch_config(_write_config(tmp_path))
    plan = plan_memory(arch, PlanConfig(memory="80GiB", dtype="float16"))
    s = plan.plan
    assert plan.num_parameters == PARAMS_7B == 6_738_415_616
    assert s.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert s.weight_bytes == PARAMS_7B * 2
    act = _activations(2, 4096, 4096, 4096, 11008, 32000, 4096)
    blocks = (int(80 * GIB * 0.9) - PARAMS_7B * 2 - act) // (524_288 * 16)
    assert s.num_blocks == blocks
    assert s.max_seqs_at_max_len == blocks // 256  # 4096 / 16
    assert [v.label for v in plan.variants] == ["MHA (model)", "GQA", "MQA"]
    mha, gqa, mqa = plan.variants
    assert (gqa.num_kv_heads, gqa.kv_bytes_per_token) == (8, 524_288 // 4)
    assert gqa.weight_bytes == PARAMS_7B_GQA8 * 2
    assert mqa.kv_bytes_per_token == 524_288 // 32
    assert mha.num_blocks == blocks


def test_7b_gqa_by_hand(tmp_path):
    arch, _ = load_arch_config(_write_config(tmp_path, num_key_value_heads=8))
    cfg = PlanConfig(memory="24GiB", dtype="float16", avg_prompt_len=1000, avg_output_len=200, width=4)
    plan = plan_memory(arch, cfg)
    s = plan.plan
    assert s.kv_bytes_per_token == 131_072 == 524_288 // 4
    assert s.weight_bytes == PARAMS_7B_GQA8 * 2
    act = _activations(2, 4096, 4096, 1024, 11008, 32000, 4096)
    blocks = (int(24 * GIB * 0.9) - PARAMS_7B_GQA8 * 2 - act) // (131_072 * 16)
    assert s.num_blocks == blocks
    # Width 4: the prompt's 62 full blocks once; each branch holds ceil(1200 / 16) - 62 = 13 blocks.
    assert blocks_per_request(1000, 200, 16, 4) == 62 + 4 * 13
    assert s.max_requests_at_avg == blocks // (62 + 4 * 13)
    assert s.max_seqs_at_avg == 4 * s.max_requests_at_avg
    # At max length every branch runs to 4096 tokens: 62 + 4 x (256 - 62) blocks.
    assert s.max_requests_at_max_len == blocks // (62 + 4 * 194)
    assert [v.label for v in plan.variants] == ["MHA", "GQA (model)", "MQA"]


def test_hf_directory_reads_config_only(tmp_path):
    _write_config(tmp_path, num_key_value_heads=8)
    arch, path = load_arch_config(str(tmp_path))  # no weights in the directory: never read
    assert path == str(tmp_path) and arch.num_kv_heads == 8


def test_concurrency_warning(tmp_path):
    arch, _ = load_arch_config(_write_config(tmp_path))
    plan = plan_memory(arch, PlanConfig(memory="24GiB", dtype="float16", concurrency=1000))
    assert len(plan.warnings) == 1 and "requested concurrency 1000 does not fit" in plan.warnings[0]
    ok = plan_memory(arch, PlanConfig(memory="24GiB", dtype="float16", concurrency=plan.plan.max_requests_at_avg))
    assert ok.warnings == []


@pytest.mark.parametrize("kwargs, field", [
    ({"memory": -1}, "memory"), ({"memory": 0}, "memory"), ({"memory": "-4GiB"}, "memory"),
    ({"memory": "lots"}, "memory"), ({"kv_dtype": "int4"}, "kv_dtype"), ({"dtype": "float64"}, "dtype"),
    ({"utilization": 0}, "utilization"), ({"utilization": 1.5}, "utilization"), ({"block_size": 0}, "block_size"),
    ({"width": 0}, "width"), ({"max_model_len": 1}, "max_model_len"), ({"avg_prompt_len": -3}, "avg_prompt_len"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PlanConfig(**{"memory": "1GiB", **kwargs})


def test_model_that_does_not_fit(tmp_path):
    arch, _ = load_arch_config(_write_config(tmp_path))
    with pytest.raises(ValueError, match="does not fit.*weights"):
        plan_memory(arch, PlanConfig(memory="8GiB", dtype="float16"))  # 13.5 GB of weights
    # Weights fit but not one block after them: still a clear error.
    need = PARAMS_7B * 2 + _activations(2, 4096, 4096, 4096, 11008, 32000, 4096) + 1000
    with pytest.raises(ValueError, match="does not fit.*too small"):
        plan_memory(arch, PlanConfig(memory=need, utilization=1.0, dtype="float16"))
    with pytest.raises(ValueError, match="avg_output_len"):
        plan_memory(arch, PlanConfig(memory="80GiB", avg_prompt_len=4000, avg_output_len=200))


def test_pool_blocks_and_variants_helpers():
    assert kv_pool_blocks(46_080 * 16 * 10 + 5, 46_080, 16) == 10
    with pytest.raises(ValueError, match="kv_cache_memory"):
        kv_pool_blocks(100, 46_080, 16)
    assert blocks_per_request(8192, 0, 16) == 512 and blocks_per_request(17, 0, 16, width=3) == 1 + 3
    assert attention_variants(32, 32) == [("MHA", 32), ("GQA", 8), ("MQA", 1)]
    assert attention_variants(9, 3) == [("MHA", 9), ("GQA", 3), ("MQA", 1)]
    assert attention_variants(7, 7) == [("MHA", 7), ("MQA", 1)]  # no grouping divides 7 heads


def test_cli_json(tmp_path, capsys):
    cfg = _write_config(tmp_path, num_key_value_heads=8)
    assert main(["memory", "--model", cfg, "--memory", "24GiB", "--dtype", "float16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["kv_bytes_per_token"] == 131_072
    assert [v["num_kv_heads"] for v in out["variants"]] == [32, 8, 1]


def test_cli_text_and_errors(tmp_path, capsys):
    assert main(["memory", "--memory", "2GiB", "--kv-dtype", "int8", "--concurrency", "500"]) == 0
    text = capsys.readouterr().out
    assert "2 x 30 layers x 3 kv_heads x (64 head_dim x 1 byte + 4 bytes float32 scale)" in text
    assert "= 12,240 bytes" in text and "MQA" in text and "warning: requested concurrency 500" in text
    assert main(["memory", "--memory=-1GiB"]) == 2
    assert "memory" in capsys.readouterr().err
    assert main(["memory", "--memory", "2GiB", "--kv-dtype", "int3"]) == 2
    assert "kv_dtype" in capsys.readouterr().err
    assert main(["memory", "--model", _write_config(tmp_path), "--memory", "8GiB", "--dtype", "float16"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_gguf_header_reader_matches_the_full_reader(tmp_path):
    from helpers import bundled_path
    from kvshare.model import gguf_loader
    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.loader import ModelLoadError

    whole = open_gguf_file(bundled_path())
    full = gguf_loader.config_from_gguf(whole.metadata, whole, bundled_path())
    assert load_arch_config(bundled_path())[0] == full
    cut = tmp_path / "cut.gguf"
    with open(bundled_path(), "rb") as f:
        cut.write_bytes(f.read(5000))  # ends inside the tokenizer arrays
    with pytest.raises(ModelLoadError, match="truncated"):
        load_arch_config(str(cut))


def test_planned_weights_are_what_the_engine_holds():
    """Kept-quantized (the default) and dequantized plans count the bytes the engine really holds."""
    from kvshare import LLM
    from kvshare.memory_plan import gguf_weight_formats
    from helpers import bundled_path

    formats = gguf_weight_formats(bundled_path())
    assert formats == {"Q8_0": 49152 * 576, "Q4_1": 30 * (576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536)}
    for quantization, weight_formats in (("auto", formats), (None, None)):
        llm = LLM(dtype="float32", quantization=quantization, kv_cache_memory="8MiB")
        arch = llm.engine.model_config
        plan = plan_memory(arch, PlanConfig(memory="4GiB", weight_formats=weight_formats))
        assert plan.plan.weight_bytes == llm.engine.model.weight_bytes
