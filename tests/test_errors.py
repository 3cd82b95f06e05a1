"""Bad input gets a clear error naming the field; the engine then serves the next request."""
from __future__ import annotations

import os
import shutil

import pytest

from helpers import EXACT, bundled_path
from kvshare import LLM, SamplingParams
from kvshare.errors import InvalidRequestError
from kvshare.model.loader import ModelLoadError


@pytest.fixture(scope="module")
def llm():
    return LLM(**EXACT, kv_cache_memory="32MiB", max_model_len=256)


def _still_serves(llm):
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.manager.num_used_blocks() == 0
    assert not llm.engine.scheduler.has_work()


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", SamplingParams(max_tokens=4), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), "prompt"),
        ({"prompt_token_ids": [1, 2, 10**9]}, SamplingParams(max_tokens=4), "prompt"),
        ("word " * 300, SamplingParams(max_tokens=4), "max_model_len"),
        ("Hello", SamplingParams(max_tokens=400), "max_tokens"),
    ],
)
def test_bad_requests_rejected_then_serving_continues(llm, prompt, params, field):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([prompt], params, use_tqdm=False)
    assert field in str(err.value)
    _still_serves(llm)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params(llm, kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value)
    _still_serves(llm)


def test_one_bad_prompt_in_a_list_leaves_nothing_behind(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    _still_serves(llm)


def test_request_larger_than_pool_is_rejected():
    # 46080 bytes/token in float32: 4 blocks of 16 tokens = 64 slots.
    small = LLM(**EXACT, kv_cache_memory=46080 * 16 * 4)
    with pytest.raises(InvalidRequestError) as err:
        small.generate(["Hello"], SamplingParams(max_tokens=100), use_tqdm=False)
    assert "KV pool" in str(err.value)
    _still_serves(small)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(tmp_path / "no-such-model"))
    assert "model" in str(err.value)


def test_truncated_gguf(tmp_path):
    src = bundled_path()
    dst = tmp_path / "truncated.gguf"
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(os.path.getsize(src) // 3))
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(dst))
    assert "truncated" in str(err.value).lower() or "corrupt" in str(err.value).lower()


def test_unknown_engine_option():
    with pytest.raises(TypeError) as err:
        LLM(block_sise=16)
    assert "block_sise" in str(err.value)


def test_bad_engine_option_values():
    for kwargs, field in [(dict(block_size=0), "block_size"), (dict(dtype="int3"), "dtype"),
                          (dict(prefill_dtype="int8"), "prefill_dtype"),
                          (dict(kv_cache_memory="lots"), "kv_cache_memory"), (dict(max_num_seqs=-1), "max_num_seqs")]:
        with pytest.raises(ValueError) as err:
            LLM(**kwargs)
        assert field in str(err.value)


def test_prefill_dtype_resolves_per_cpu_and_mode():
    from kvshare.config import EngineConfig, cpu_has_avx512_bf16

    native = "bfloat16" if cpu_has_avx512_bf16() else "float32"
    assert EngineConfig().dtype == "float32"  # "auto" activations are float32 on every CPU
    assert EngineConfig().prefill_dtype == native
    assert EngineConfig(prefill_dtype="float32").prefill_dtype == "float32"
    assert EngineConfig(prefill_dtype="bf16").prefill_dtype == "bfloat16"
    # dequantized weights have no scratch GEMM: the activation dtype throughout
    assert EngineConfig(dtype="float32", quantization=None).prefill_dtype == "float32"
    assert EngineConfig(dtype="bfloat16").prefill_dtype == "bfloat16"
