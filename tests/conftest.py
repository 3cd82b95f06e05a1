import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Two cores: keep torch from oversubscribing when the suite runs beside other work.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The suite is a testing environment: planted faults (kvshare.testing.faults, --inject-fault) run
# here, in this process and in the servers it starts; tests/test_fault_gate.py checks the refusal without it.
os.environ["KVSHARE_TESTING"] = "1"


@pytest.fixture(scope="session", autouse=True)
def load_real_models_once():
    """Engines built from the two real model files (the bundled SmolLM2 GGUF, the packaged Gemma 3
    270M) share one load per (file, dtype, quantization) in this test process: the suite builds
    ~100 engines, and dequantizing the same GGUF again each time was minutes of the budget. Each
    engine gets its own copy of the weights dict (the model builder pops from it); the tensors are
    shared read-only, as the model never writes its weights. The loader itself is tested directly
    (test_loader.py, test_gguf_quants.py, ...), which calls kvshare.model.loader.load_model unpatched.
    KVSHARE_TEST_NO_LOAD_CACHE=1 turns this off."""
    if os.environ.get("KVSHARE_TEST_NO_LOAD_CACHE") == "1":
        yield
        return
    import copy
    import dataclasses

    from kvshare.engine import llm_engine
    from kvshare.model import loader

    real_files = {os.path.realpath(loader.bundled_model_path())}
    try:
        real_files.add(os.path.realpath(loader.packaged_model_path("gemma3-270m")))
    except Exception:  # not assembled: its tests say so themselves
        pass
    cache: dict = {}
    original = llm_engine.load_model

    def cached_load(model, dtype=None, quantization=None):
        try:
            _, path = loader.resolve_model_path(model)
        except Exception:
            return original(model, dtype=dtype, quantization=quantization)
        path = os.path.realpath(path)
        if path not in real_files:
            return original(model, dtype=dtype, quantization=quantization)
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, dtype, quantization)
        if key not in cache:
            cache[key] = original(model, dtype=dtype, quantization=quantization)
        hit = cache[key]
        # A shallow copy of the tokenizer too, so a test patching one engine's tokenizer leaves the others'.
        return dataclasses.replace(hit, weights=dict(hit.weights), tokenizer=copy.copy(hit.tokenizer))

    llm_engine.load_model = cached_load
    try:
        yield
    finally:
        llm_engine.load_model = original
