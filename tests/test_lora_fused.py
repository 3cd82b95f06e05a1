"""LoRA deltas in C++ (csrc/decode_step.cpp `lora_row`): inside the fused decode step for adapter
rows, and through `kvs_lora_apply` for rows the step-by-step path takes (kvshare/model/lora.py).

The bounds: the C++ delta sums x A^T in 16 float lanes, PyTorch's reference in its own order, so
they differ by float32 rounding alone (a relative 1e-5 of the delta's size is ~100 ulps of room
for sums of 576-1536 terms). Fused against step-by-step with adapters: the same bound and reason
as tests/test_fused_decode.py's LOGPROB_TOL (the delta is the same function on both; only the base
layer's element-wise ops differ), on weights in rows and a float32 cache as there."""
from __future__ import annotations

import ctypes

import pytest
import torch

from helpers import english_token_prompts, greedy_agreement
from kvshare import LLM, SamplingParams
from kvshare.model.kernels import decode_step, qmatmul
from kvshare.model.lora import SITES, LoRAAdapter, LoRABatch, module_shapes
from test_fused_decode import LOGPROB_TOL, _fill_cache, _row_meta, _token_rows

RANK = 4


@pytest.fixture(scope="module", autouse=True)
def built():
    assert decode_step.DECODE.wait_until_built(), decode_step.DECODE.unavailable_reason()
    qmatmul.QMATMUL.wait_until_built()


def random_adapter(config, name: str, seed: int, modules=None, scale: float = 2.0) -> LoRAAdapter:
    """An adapter with random A and B on every layer's `modules` (all seven by default)."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    weights = {}
    for layer in range(config.num_layers):
        for m in modules or shapes:
            out_f, in_f = shapes[m]
            weights[(layer, m)] = (torch.randn(RANK, in_f, generator=g) * 0.5 / in_f ** 0.5,
                                   torch.randn(out_f, RANK, generator=g) * 0.5 / RANK ** 0.5)
    return LoRAAdapter(name, f"<random {seed}>", scale, RANK, weights, f"digest-{seed}")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm(request):
    return LLM(kv_cache_memory="16MiB", enable_prefix_caching=False, dtype=request.param,
               kv_cache_dtype="bfloat16", enable_lora=True)


def _site_inputs(config, site: str, M: int, dtype, seed: int):
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    k = shapes[SITES[site][0]][1]
    n = sum(shapes[m][0] for m in SITES[site])
    return torch.randn(M, k, generator=g).to(dtype), torch.randn(M, n, generator=g).to(dtype)


def test_cpp_delta_matches_pytorch_and_its_portable_code(llm):
    """kvs_lora_apply (the step-by-step path's C++ delta) against LoRABatch's PyTorch delta, on
    every site, rows of two adapters and of none; its scalar code against its AVX-512 code."""
    config = llm.engine.model.config
    a = random_adapter(config, "a", 1)
    b = random_adapter(config, "b", 2, modules=["q_proj", "v_proj", "down_proj"])
    dtype = llm.engine.model.dtype
    for i, site in enumerate(SITES):
        x, y = _site_inputs(config, site, 7, dtype, seed=i)
        groups = [(a, torch.tensor([0, 3, 4])), (b, torch.tensor([1, 6]))]
        torch_delta = LoRABatch(groups, config).apply(1, site, x, y.clone())
        native = LoRABatch(groups, config)
        native.native = True
        got = native.apply(1, site, x, y.clone())
        portable = native._apply_native(1, site, x, y.clone(), portable=True)
        assert torch.equal(got, portable), site
        assert torch.equal(got[[2, 5]], y[[2, 5]]), "a row of no adapter is left as it is"
        assert not torch.equal(got[[0, 3, 4, 1, 6]], y[[0, 3, 4, 1, 6]])
        if dtype == torch.float32:
            scale = (torch_delta - y).abs().max()
            assert (got - torch_delta).abs().max() <= 1e-5 * scale, site
        else:  # a bfloat16 rounding may flip: one step of the larger value's bfloat16 grid
            assert ((got.float() - torch_delta.float()).abs() <= y.float().abs() / 64 + 1e-2).all(), site


def test_bad_adapter_rows_are_refused(llm):
    config = llm.engine.model.config
    a = random_adapter(config, "a", 1)
    batch = LoRABatch([(a, torch.tensor([0]))], config)
    x, y = _site_inputs(config, "o", 2, llm.engine.model.dtype, seed=0)
    rows = batch.c_rows(2)
    ctypes.cast(rows.row_adapter, ctypes.POINTER(ctypes.c_int64))[1] = 5
    widths = (ctypes.c_int64 * 1)(y.shape[1])
    err = ctypes.create_string_buffer(256)
    xf, yf = x.float().contiguous(), y.float().contiguous()
    rc = decode_step.DECODE.lib().kvs_lora_apply(ctypes.byref(rows), config.num_layers, 0, 3, widths, 1,
                                                 xf.data_ptr(), xf.shape[1], yf.data_ptr(), yf.shape[1], 2, 0, 0, 1,
                                                 err, len(err))
    assert rc == 1 and b"row 1: adapter index 5 out of range [-1, 1)" in err.value
    assert torch.equal(yf, y.float()), "nothing written"


def test_fused_rows_with_adapters_equal_each_row_alone(llm):
    """kvs_decode_layers on 17 token rows under two adapters and none: each row equals, bit for
    bit, the same row alone under its adapter; its scalar code gives the same bits; rows of no
    adapter get what they get in a call without adapters, adapter rows something else."""
    model, cache = llm.engine.model, llm.engine.kv_cache
    fused = model.fused_decode
    assert fused.takes_adapters
    config = model.config
    a, b = random_adapter(config, "a", 1), random_adapter(config, "b", 2, modules=["k_proj", "o_proj", "up_proj"])
    M = 17
    h, tables, meta = _token_rows(model, cache, seed=3, M=M)
    which = [r % 3 for r in range(M)]  # 0: a, 1: b, 2: none
    batch = LoRABatch([(a, torch.tensor([r for r in range(M) if which[r] == 0])),
                       (b, torch.tensor([r for r in range(M) if which[r] == 1]))], config)
    _fill_cache(cache, seed=4)
    before = cache.data.clone()
    batched = fused.run(h.clone(), tables, meta, cache, batch)
    after = cache.data.clone()
    cache.data.copy_(before)
    fused.portable = True
    try:
        assert torch.equal(fused.run(h.clone(), tables, meta, cache, batch), batched)
    finally:
        fused.portable = False
    assert torch.equal(cache.data, after)
    cache.data.copy_(before)
    base = fused.run(h.clone(), tables, meta, cache)
    for r in range(M):
        cache.data.copy_(after)
        row = [(c[r:r + 1], s[r:r + 1]) for c, s in tables]
        alone_batch = None if which[r] == 2 else LoRABatch([((a, b)[which[r]], torch.tensor([0]))], config)
        alone = fused.run(h[r:r + 1].clone(), row, _row_meta(meta, r), cache, alone_batch)
        assert torch.equal(alone[0], batched[r]), f"row {r}"
        # (row 0 reads only its own new K/V, the same with or without the others' adapters)
        if which[r] == 2 and r == 0:
            assert torch.equal(batched[r], base[r])
        if which[r] != 2:
            assert not torch.equal(batched[r], base[r]), f"row {r}: the adapter changed nothing"


def save_peft(adapter: LoRAAdapter, path) -> str:
    """The adapter in PEFT's form (adapter_config.json + adapter_model.safetensors), scale = alpha / r."""
    import json

    from safetensors.torch import save_file

    path.mkdir()
    tensors = {}
    for (layer, m), (a, b) in adapter.weights.items():
        where = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{where}.{m}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with open(path / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.scale * adapter.rank,
                   "target_modules": sorted({m for _, m in adapter.weights})}, f)
    return str(path)


def test_fused_and_step_by_step_agree_with_adapters(tmp_path):
    """Generation under two adapters and the base model in one batch, decode steps on the fused
    step against the step-by-step path (fused.enabled off), both with C++'s delta: the same tokens
    and logprobs within LOGPROB_TOL (weights in rows, a float32 cache: tests/test_fused_decode.py's
    setting)."""
    from kvshare import LoRARequest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qmatmul, "vnni_blocks_fit", lambda *a: False)
        llm = LLM(kv_cache_memory="32MiB", enable_prefix_caching=False, kv_cache_dtype="float32", dtype="float32",
                  enable_lora=True, max_loras=2)
    engine = llm.engine
    fused = engine.model.fused_decode
    config = engine.model.config
    requests = [LoRARequest("a", 1, save_peft(random_adapter(config, "a", 1), tmp_path / "a")),
                LoRARequest("b", 2, save_peft(random_adapter(config, "b", 2, modules=["q_proj", "gate_proj"]),
                                              tmp_path / "b")), None]
    prompts = english_token_prompts(llm.get_tokenizer().encode, [9, 40, 75])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    calls = []
    run = fused.run

    def counting(h, tables, meta, kv_cache, lora=None):
        calls.append(lora is not None)
        return run(h, tables, meta, kv_cache, lora)

    fused.run = counting
    try:
        results = {}
        for enabled in (True, False):
            fused.enabled = enabled
            results[enabled] = _generate(engine, prompts, params, requests)
    finally:
        fused.enabled = True
        del fused.run
    assert any(calls), "no fused step carried adapter rows"
    identical, worst = greedy_agreement(results[True], results[False])
    assert identical == len(prompts) and worst < LOGPROB_TOL, (identical, worst)
    base = _generate(engine, prompts, params, [None] * 3)
    assert [o.outputs[0].token_ids for o in base][2] == results[True][2].outputs[0].token_ids
    assert all(b.outputs[0].token_ids != o.outputs[0].token_ids or b.outputs[0].logprobs != o.outputs[0].logprobs
               for b, o in zip(base[:2], results[True][:2])), "an adapter changed nothing"


def _generate(engine, prompts, params, lora_requests):
    """The prompts generated in one batch, prompt i under lora_requests[i]."""
    for i, (p, lora) in enumerate(zip(prompts, lora_requests)):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[str(i)] for i in range(len(prompts))]
