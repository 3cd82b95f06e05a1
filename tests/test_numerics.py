"""The numerics policy (kvshare/model/numerics.py): the kernel each kind of row takes is decided
when the engine is built, from the libraries that load then; a mode that needs a library that
does not load refuses to start, naming it; and nothing built changes its kernel when a build
finishes later."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import EXACT
from kvshare.model import kernels
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.kernels import build, decode_step, paged_attention, qmatmul
from kvshare.model.numerics import MissingKernelError, needed_libraries, resolve_numerics

NO_COMPILER = "RuntimeError: no C++ compiler found: neither c++ nor g++ is on PATH (install g++ or set CXX)"
ALL_LOADED = {"paged_attention": None, "qmatmul": None, "decode_step": None}


def test_default_mode_refuses_to_start_naming_the_missing_kernel():
    for missing in ("paged_attention", "qmatmul", "decode_step"):
        with pytest.raises(MissingKernelError, match=f"default mode needs the C\\+\\+ kernel library '{missing}'") as e:
            resolve_numerics("default", True, {**ALL_LOADED, missing: NO_COMPILER})
        assert NO_COMPILER in str(e.value) and build.DISABLE_ENV in str(e.value)


def test_a_failed_builds_log_is_named_in_the_refusal():
    why = ("RuntimeError: compiling qmatmul.cpp failed (exit 1): c++ -O3 qmatmul.cpp -o lib.so "
           "(full log: /tmp/kvshare_qmatmul_0123.build.log)\nqmatmul.cpp:1:1: error: broken")
    with pytest.raises(MissingKernelError, match="full log: /tmp/kvshare_qmatmul_0123.build.log"):
        resolve_numerics("default", True, {**ALL_LOADED, "qmatmul": why})


def test_the_default_mode_without_kept_quantized_weights_needs_only_attention():
    assert needed_libraries("default", False) == (["paged_attention"], [])
    policy = resolve_numerics("default", False, {"paged_attention": None})
    assert policy.uses("paged_attention") and not policy.uses("qmatmul")
    assert policy.kernel("decode linears") == "dense" and policy.kernel("decode steps") == "layer by layer"


def test_the_exact_mode_records_the_pytorch_path_it_takes_instead():
    policy = resolve_numerics("exact", False, {"paged_attention": NO_COMPILER})
    assert not policy.uses("paged_attention")
    assert policy.kernel("decode attention").startswith("PyTorch")
    assert policy.kernel("prompt attention") == "SDPA"
    assert "PyTorch in place of paged_attention (RuntimeError: no C++ compiler found" in policy.describe()


def test_disabling_the_kernels_chooses_pytorch_in_every_mode():
    off = f"disabled by {build.DISABLE_ENV}=1"
    policy = resolve_numerics("default", True, dict.fromkeys(ALL_LOADED, off), disabled=True)
    assert not any(policy.uses(name) for name in ALL_LOADED)
    assert policy.kernel("decode linears") == "dense copies of the dequantized weights"


def test_every_kernel_loaded():
    policy = resolve_numerics("default", True, ALL_LOADED, attention_paths=["scalar", "avx2", "avx512"])
    assert all(policy.uses(name) for name in ALL_LOADED)
    assert policy.kernel("decode linears") == "C++ int8 / int4 group matmul"
    # The default mode's token rows (issue 28): prompt rows take the decode rows' kernels.
    assert policy.token_rows
    assert policy.kernel("prompt attention").startswith("as decode rows (C++ paged kernel")
    assert policy.kernel("prompt linears") == "as decode rows (C++ int8 / int4 group matmul)"
    assert policy.kernel("decode steps").startswith("one fused C++ call")
    # The exact mode keeps its prompt kernels (HF parity, not token rows).
    exact = resolve_numerics("exact", False, {"paged_attention": None}, attention_paths=["scalar", "avx2", "avx512"])
    assert not exact.token_rows
    assert exact.kernel("prompt attention").startswith("C++ causal kernel")
    assert resolve_numerics("exact", False, {"paged_attention": None}, attention_paths=["scalar", "avx2"]).kernel(
        "prompt attention") == "SDPA"
    with pytest.raises(ValueError, match="numerics mode 'fast'"):
        resolve_numerics("fast", True, ALL_LOADED)


@pytest.fixture
def without_compiler(monkeypatch, tmp_path):
    """Fresh libraries in place of the loaded ones, in a process with no C++ compiler and an empty
    cache: they fail to load (at once, no compile). The real libraries are loaded first, so that
    nothing touching them under this environment (an engine's start) leaves them unloaded."""
    monkeypatch.delenv(build.DISABLE_ENV, raising=False)
    for library in kernels.LIBRARIES:
        library.wait_until_built()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "kernels"))
    fresh = {
        "attention": build.KernelLibrary("paged_attention", "paged_attention.cpp", paged_attention._setup_attention),
        "qmatmul": build.KernelLibrary("qmatmul", "qmatmul.cpp", qmatmul._setup_qmatmul),
        "decode_step": build.KernelLibrary("decode_step", "decode_step.cpp", decode_step._setup_decode),
    }
    monkeypatch.setattr(paged_attention, "ATTENTION", fresh["attention"])
    monkeypatch.setattr(qmatmul, "QMATMUL", fresh["qmatmul"])
    monkeypatch.setattr(decode_step, "DECODE", fresh["decode_step"])
    return fresh


def _finish_build_later(library: build.KernelLibrary) -> None:
    """What a background build finishing would do: the library is loaded from now on (with a
    stand-in no kernel may call: a step that reached for it would fail)."""
    library._lib = object()
    assert library.available()


def test_an_attention_backend_built_without_its_kernel_never_switches(without_compiler):
    from kvshare.model.attention import TorchPagedAttention

    backend = TorchPagedAttention(16)
    assert not backend.use_cpp_kernel and backend.wants_decode_groups
    _finish_build_later(without_compiler["attention"])
    assert not backend.use_cpp_kernel and backend.wants_decode_groups


def test_a_quantized_linear_built_without_its_kernel_never_switches(without_compiler):
    from kvshare.model.qlinear import DequantScratch, GroupInt8Linear

    g = torch.Generator().manual_seed(0)
    w = GroupAffine(torch.randint(-8, 8, (32, 64), generator=g, dtype=torch.int8), torch.rand(32, 2, generator=g),
                    None, 32, 5)
    lin = GroupInt8Linear(w, torch.float32, DequantScratch())
    x = torch.randn(3, 64, generator=g)
    want = F.linear(x, w.dequantize())
    assert torch.allclose(lin(x, decode_rows=3), want, atol=1e-5)
    _finish_build_later(without_compiler["qmatmul"])
    assert torch.allclose(lin(x, decode_rows=3), want, atol=1e-5)  # the dense copy still: no kernel call
    assert torch.allclose(lin(x, decode_rows=0), want, atol=1e-5)


def test_an_engine_refuses_the_default_mode_without_its_kernels(without_compiler):
    from kvshare.config import EngineConfig
    from kvshare.engine.llm_engine import LLMEngine

    with pytest.raises(MissingKernelError, match="library 'paged_attention'.*no C\\+\\+ compiler found"):
        LLMEngine(EngineConfig.from_kwargs(kv_cache_memory="16MiB"))


def test_an_exact_engine_without_its_kernel_records_the_pytorch_path(without_compiler, caplog):
    from kvshare.config import EngineConfig
    from kvshare.engine.llm_engine import LLMEngine

    with caplog.at_level("INFO", logger="kvshare"):
        engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, kv_cache_memory="16MiB"))
    assert engine.numerics.mode == "exact" and not engine.numerics.uses("paged_attention")
    assert not engine.model.backend.use_cpp_kernel
    assert any("numerics: exact mode; decode attention: PyTorch" in r.getMessage() for r in caplog.records)
    _finish_build_later(without_compiler["attention"])
    assert not engine.model.backend.use_cpp_kernel
