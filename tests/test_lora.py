"""LoRA adapters (issue 32 parts 1 and 4): parity with HF transformers + PEFT, the GGUF LoRA form,
the adapter in every cache key, bit-transparent mixed-adapter batches, clear errors."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import EXACT, bundled_path, default_mode_logprob_tolerance, hf_reference, tiny_model
from kvshare import LLM, LoRARequest, SamplingParams
from kvshare.errors import InvalidRequestError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 4


def make_peft_adapter(model, path, seed: int, r: int = 4, alpha: float = 8.0, targets=TARGETS, spread: float = 0.5):
    """A random-weight PEFT adapter on `model` (HF, modified in place: the returned PeftModel is the
    reference), saved to `path`."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * spread / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(path)
    peft_model.eval()
    return peft_model


def chosen_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def reference_logprobs(peft_model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    first = len(prompt) - 1
    return [logits[first + i, t].item() for i, t in enumerate(tokens)]


PARAMS = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)


def test_tiny_qwen2_adapter_matches_peft_in_exact_mode(tmp_path):
    model = tiny_model("qwen2", tmp_path / "base", num_key_value_heads=2)
    peft_model = make_peft_adapter(model, tmp_path / "a", seed=1)
    llm = LLM(str(tmp_path / "base"), **EXACT, kv_cache_memory="4MiB", enable_lora=True)
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=lora, use_tqdm=False)[0]
    base = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
    ref = reference_logprobs(peft_model, prompt, out.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(chosen_logprobs(out), ref)) < 1e-3
    with peft_model.disable_adapter():
        ref_base = reference_logprobs(peft_model, prompt, out.outputs[0].token_ids)
    # The adapter matters here: the base model is far from it on the same tokens.
    assert max(abs(a - b) for a, b in zip(ref_base, ref)) > 0.05
    assert base.outputs[0].token_ids != out.outputs[0].token_ids or chosen_logprobs(base) != chosen_logprobs(out)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """The bundled model's HF reading with a random adapter A (q/k/v/o and MLP), adapter B (attention
    only), both saved in PEFT form, and the same A written as a llama.cpp GGUF LoRA."""
    root = tmp_path_factory.mktemp("lora")
    model, tok = hf_reference()
    # A copy: PEFT injects its layers into the model it wraps, and hf_reference() is the cached
    # numeric reference every other test module compares with.
    peft_a = make_peft_adapter(copy.deepcopy(model), root / "a", seed=5)
    with open(root / "a" / "adapter_config.json") as f:
        cfg = json.load(f)
    b_dir = root / "b"
    b_dir.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(root / "a" / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(9)
    save_file({k: torch.randn(v.shape, generator=g) * 0.5 / v.shape[-1] ** 0.5 for k, v in tensors.items()
               if "mlp" not in k}, str(b_dir / "adapter_model.safetensors"))
    with open(b_dir / "adapter_config.json", "w") as f:
        json.dump({**cfg, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, f)
    write_gguf_lora(tensors, cfg["lora_alpha"], root / "a.gguf", n_head=9, n_kv_head=3)
    prompt = tok("The capital of France is a city that", add_special_tokens=False)["input_ids"]
    return {"root": root, "peft_a": peft_a, "prompt": prompt, "a": str(root / "a"), "b": str(b_dir),
            "a_gguf": str(root / "a.gguf"), "tensors": tensors}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row interleave (what its converter applies to lora_b of q and k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(tensors: dict, alpha: float, path, n_head: int, n_kv_head: int) -> None:
    import gguf

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for key, t in sorted(tensors.items()):
        parts = key.split(".")
        i = parts.index("layers")
        layer, module, kind = int(parts[i + 1]), parts[i + 3], parts[i + 4]
        if kind == "lora_B" and module in ("q_proj", "k_proj"):
            t = _permute(t, n_head if module == "q_proj" else n_kv_head)
        w.add_tensor(f"blk.{layer}.{names[module]}.weight.{'lora_a' if kind == 'lora_A' else 'lora_b'}",
                     t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bundled_adapter_matches_peft_exact_and_default_modes(bundled):
    prompt = bundled["prompt"]
    lora = LoRARequest("a", 1, bundled["a"])
    exact = LLM(**EXACT, kv_cache_memory="16MiB", enable_lora=True)
    out = exact.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=lora, use_tqdm=False)[0]
    ref = reference_logprobs(bundled["peft_a"], prompt, out.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(chosen_logprobs(out), ref)) < 1e-3
    del exact
    default = LLM(kv_cache_memory="16MiB", enable_lora=True)
    got = default.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=lora, use_tqdm=False)[0]
    ref = reference_logprobs(bundled["peft_a"], prompt, got.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(chosen_logprobs(got), ref)) < default_mode_logprob_tolerance(default)


def test_gguf_lora_loads_to_the_peft_weights(bundled):
    from kvshare.model.lora import load_adapter

    llm = LLM(kv_cache_memory="8MiB", enable_lora=True)
    config = llm.engine.model_config
    peft = load_adapter("a", bundled["a"], config, 16)
    gguf_form = load_adapter("a", bundled["a_gguf"], config, 16)
    assert peft.scale == gguf_form.scale == 2.0
    assert set(peft.weights) == set(gguf_form.weights) and len(peft.weights) == 7 * config.num_layers
    for k, (a, b) in peft.weights.items():
        assert torch.equal(a, gguf_form.weights[k][0]) and torch.equal(b, gguf_form.weights[k][1]), k
    assert peft.key == gguf_form.key  # same name, weights and scale: the same cache identity


@pytest.fixture(scope="module")
def served(bundled):
    """The default-mode engine with A, B and A at another scale (a copy with lora_alpha doubled)."""
    root = bundled["root"]
    a2 = root / "a2"
    a2.mkdir()
    import shutil

    shutil.copy(root / "a" / "adapter_model.safetensors", a2)
    with open(root / "a" / "adapter_config.json") as f:
        cfg = json.load(f)
    with open(a2 / "adapter_config.json", "w") as f:
        json.dump({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}, f)
    llm = LLM(kv_cache_memory="16MiB", enable_lora=True, max_loras=4, audit=True)
    loras = {"A": LoRARequest("A", 1, bundled["a"]), "B": LoRARequest("B", 2, bundled["b"]),
             "A2": LoRARequest("A2", 3, str(a2))}
    return llm, loras


def _five_way(bundled, loras):
    prompt = {"prompt_token_ids": bundled["prompt"] * 3}
    salted = dict(prompt, cache_salt="tenant-x")
    return [(prompt, loras["A"]), (prompt, loras["B"]), (prompt, None), (prompt, loras["A2"]), (salted, loras["A"])]


def test_five_way_identical_prompts_share_no_block_and_a_mixed_batch_equals_each_alone(bundled, served):
    llm, loras = served
    engine = llm.engine
    cases = _five_way(bundled, loras)
    alone, hashes = [], []
    for prompt, lora in cases:
        engine.reset_prefix_cache()
        assert not engine.cached_block_hashes()
        alone.append(llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)[0])
        hashes.append(engine.cached_block_hashes())
        assert hashes[-1], "each namespace publishes blocks of its own"
    # The same tokens each time: only the namespace (adapter, scale, salt) tells the blocks apart.
    for i in range(len(hashes)):
        for j in range(i):
            assert not hashes[i] & hashes[j], (i, j)
    engine.reset_prefix_cache()
    mixed = llm.generate([p for p, _ in cases], PARAMS, lora_request=[lo for _, lo in cases], use_tqdm=False)
    for m, a in zip(mixed, alone):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert chosen_logprobs(m) == chosen_logprobs(a)
    outputs = {tuple(chosen_logprobs(a)) for a in alone[:4]}
    assert len(outputs) == 4  # A, B, base, A at another scale: four different outputs
    assert chosen_logprobs(alone[4]) == chosen_logprobs(alone[0])  # the salt changes keys, not the math


def test_adapter_switched_between_consecutive_requests_returns_each_adapters_own_output(bundled, served):
    """llama.cpp #26207: the same prompt, the adapter switched between requests, prefix caching on."""
    llm, loras = served
    prompt = {"prompt_token_ids": bundled["prompt"] * 3}
    llm.engine.reset_prefix_cache()
    order = ["A", None, "A", "B", "A"]
    got = [llm.generate([prompt], PARAMS, lora_request=loras.get(k), use_tqdm=False)[0] for k in order]
    first = {}
    for k, out in zip(order, got):
        first.setdefault(k, chosen_logprobs(out))
        assert chosen_logprobs(out) == first[k], k
    assert len({tuple(v) for v in first.values()}) == 3


def test_beam_search_runs_every_beam_under_its_adapter(bundled, served):
    """LLM.beam_search's lora_request (vLLM's): under A, the same beams alone and after other
    adapters and the base model ran (their blocks cached), other beams than the base model's,
    no block shared with it; one adapter per prompt in one call gives each prompt its own."""
    from kvshare.engine.beam_search import BeamSearchParams

    llm, loras = served
    engine = llm.engine
    prompt = {"prompt_token_ids": bundled["prompt"] * 3}
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)

    def beams(lora) -> list[tuple]:
        out = llm.beam_search([prompt], params, lora_request=lora)[0]
        return [(tuple(s.tokens), s.cum_logprob) for s in out.sequences]

    engine.reset_prefix_cache()
    alone = beams(loras["A"])
    a_hashes = engine.cached_block_hashes()
    engine.reset_prefix_cache()
    base = beams(None)
    base_hashes = engine.cached_block_hashes()
    assert a_hashes and base_hashes and not a_hashes & base_hashes
    assert base != alone
    b = beams(loras["B"])
    assert beams(loras["A"]) == alone  # after B and the base model, their blocks cached
    mixed = llm.beam_search([prompt] * 3, params, lora_request=[loras["B"], loras["A"], None])
    assert [[(tuple(s.tokens), s.cum_logprob) for s in o.sequences] for o in mixed] == [b, alone, base]


def test_unload_drops_blocks_and_a_changed_file_under_the_same_name_misses(bundled, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "c"
    shutil.copytree(bundled["a"], path)
    llm = LLM(kv_cache_memory="16MiB", enable_lora=True)
    engine = llm.engine
    prompt = {"prompt_token_ids": bundled["prompt"] * 3}
    lora = LoRARequest("c", 7, str(path))
    first = llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)[0]
    cached = engine.cached_block_hashes()
    assert cached and engine.list_loras() == {7}
    assert engine.remove_lora(7) and engine.list_loras() == set()
    assert not engine.cached_block_hashes() & cached  # the adapter's blocks are gone
    assert not engine.remove_lora(7)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: v * 1.5 for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    # Re-run the base to keep unrelated blocks around; then the changed file under the same name.
    second = llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert chosen_logprobs(second) != chosen_logprobs(first)


def test_unload_drops_the_adapters_copies_in_the_ram_and_disk_tiers(bundled, tmp_path):
    """Blocks of A, B and the base model evicted into a RAM tier and a disk tier: unloading A
    forgets A's entries in both (its bytes and files go with the next step), B's and the base's
    stay; A reloaded from the same file finds nothing cached."""
    import os

    from kvshare.engine.kv_tier_store import SUFFIX, read_header

    llm = LLM(kv_cache_memory="3MiB", kv_host_memory="64MiB", kv_disk_path=str(tmp_path), enable_lora=True,
              max_loras=2)  # a pool of 8 blocks of 16 tokens
    engine, tiers = llm.engine, llm.engine.kv_tiers
    prompt = {"prompt_token_ids": bundled["prompt"] * 7}  # 56 tokens: 3 full blocks
    loras = {"A": LoRARequest("A", 1, bundled["a"]), "B": LoRARequest("B", 2, bundled["b"]), None: None}
    first = {k: llm.generate([prompt], PARAMS, lora_request=lo, use_tqdm=False)[0] for k, lo in loras.items()}
    llm.generate([{"prompt_token_ids": list(range(1000, 1113))}], PARAMS, use_tqdm=False)  # evicts every block
    keys = {k: engine.loras.adapter_for(lo) for k, lo in loras.items()}

    def entries(tier: dict) -> dict:
        return {k: sum(e.adapter == key for e in tier.values()) for k, key in keys.items()}

    def files() -> dict:
        headers = [read_header(os.path.join(tmp_path, n))[0] for n in os.listdir(tmp_path) if n.endswith(SUFFIX)]
        return {k: sum(h.get("adapter") == key for h in headers) for k, key in keys.items()}

    before = {"ram": entries(tiers.ram), "disk": entries(tiers.disk), "files": files()}
    assert all(n >= 3 for counts in before.values() for n in counts.values()), before
    a_hashes = [h for h, e in tiers.ram.items() if e.adapter == keys["A"]]
    assert engine.remove_lora(1)
    assert entries(tiers.ram) == {**before["ram"], "A": 0} and entries(tiers.disk) == {**before["disk"], "A": 0}
    # The next step applies the drops: A's bytes leave RAM and its files the directory.
    base_again = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert base_again.num_cached_tokens > 0  # the base model's blocks came back from a tier
    after = files()  # (the base request evicted more base blocks meanwhile: more base files)
    assert after["A"] == 0 and after["B"] == before["files"]["B"] and after[None] >= before["files"][None]
    assert not set(a_hashes) & set(engine.runner.tier_store.ram)
    again = llm.generate([prompt], PARAMS, lora_request=LoRARequest("A", 3, bundled["a"]), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert chosen_logprobs(again) == chosen_logprobs(first["A"])


def test_bad_adapters_and_requests_get_clear_errors(bundled, tmp_path):
    from kvshare.model.lora import LoRAAdapterError, load_adapter

    off = LLM(kv_cache_memory="8MiB")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        off.generate(["hi"], PARAMS, lora_request=LoRARequest("a", 1, bundled["a"]), use_tqdm=False)
    llm = LLM(kv_cache_memory="8MiB", enable_lora=True, max_loras=1, max_lora_rank=8)
    config = llm.engine.model_config

    def adapter(name: str, **changes):
        d = tmp_path / name
        import shutil

        shutil.copytree(bundled["a"], d)
        with open(d / "adapter_config.json") as f:
            cfg = json.load(f)
        cfg.update(changes)
        with open(d / "adapter_config.json", "w") as f:
            json.dump(cfg, f)
        return str(d)

    for changes, field in [({"target_modules": ["q_proj", "lm_head"]}, "target_modules"), ({"use_dora": True}, "use_dora"),
                           ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"bias": "all"}, "bias"),
                           ({"peft_type": "IA3"}, "peft_type")]:
        with pytest.raises(LoRAAdapterError, match=field) as e:
            load_adapter("x", adapter(f"x-{field}", **changes), config, 8)
        assert e.value.field == field
    with pytest.raises(LoRAAdapterError, match="max_lora_rank=2") as e:
        load_adapter("x", bundled["a"], config, 2)
    assert e.value.field == "r"
    from safetensors.torch import load_file, save_file

    wrong = adapter("wrong-shape")
    t = load_file(wrong + "/adapter_model.safetensors")
    t = {k: (v[:, :-1].contiguous() if "q_proj.lora_A" in k else v) for k, v in t.items()}
    save_file(t, wrong + "/adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match=r"q_proj: lora_A is \[4, 575\]"):
        load_adapter("x", wrong, config, 8)
    with pytest.raises(LoRAAdapterError, match="not a GGUF LoRA adapter"):
        load_adapter("x", bundled_path(), config, 8)  # a base model file, not an adapter
    with pytest.raises(InvalidRequestError, match="max_loras=1"):
        llm.generate(["hi", "hi"], PARAMS, lora_request=[LoRARequest("a", 1, bundled["a"]),
                                                         LoRARequest("b", 2, bundled["b"])], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is loaded as 'a'"):
        llm.generate(["hi"], PARAMS, lora_request=LoRARequest("z", 1, bundled["b"]), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, bundled["a"])


def test_a_lookup_that_drops_the_adapter_is_caught_as_adapter_isolation_in_its_step(bundled):
    from kvshare.kvcache.audit import AuditError
    from kvshare.testing.faults import plant

    llm = LLM(kv_cache_memory="16MiB", enable_lora=True, audit=True)
    engine = llm.engine
    plant(engine, "lookup_ignores_adapter")
    prompt = {"prompt_token_ids": bundled["prompt"] * 3}
    llm.generate([prompt], PARAMS, use_tqdm=False)  # the base model's blocks, cached
    assert not engine.fault_fired
    with pytest.raises(AuditError) as info:  # the same prompt under adapter A
        llm.generate([prompt], PARAMS, lora_request=LoRARequest("A", 1, bundled["a"]), use_tqdm=False)
    assert engine.fault_fired, "the scenario never triggered the planted bug"
    assert info.value.invariant == "adapter_isolation", str(info.value)
    assert info.value.step == engine.fault_fired[0][0]
