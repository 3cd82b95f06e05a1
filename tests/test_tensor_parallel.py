"""Tensor parallel (issue 14 item 4): tensor_parallel_size=2 starts a second real process that
holds its share of every layer (KV heads 2 + 1 of the bundled model's 3, query heads 6 + 3, half
the MLP and of the vocabulary) and runs each step plan rank 0 broadcasts over gloo. On the
bundled model in float32 it matches TP=1: the same greedy tokens, logprobs and prompt logprobs
within 1e-4, through chunked prefill, mixed steps and prefix-cache hits. A worker that dies makes
the next step fail with an error naming it; a rank 0 that dies takes its workers with it. Issue 33:
the ranks start through a store only the server's user can open, with nothing listening on the
network, every value signed with a per-launch token, and a worker maps no segment and sizes no
KV pool it is told of unless it matches what it computes itself."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import openai
import pytest
import torch

from helpers import english_token_prompts, greedy_agreement
from kvshare import LLM, SamplingParams
from kvshare.model.config import ModelArchConfig
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.kernels import decode_step, qmatmul, shm
from kvshare.engine.model_setup import check_tensor_parallel
from kvshare.model.tensor_parallel import TPShard, even_split, shard_weights
from kvshare.model.tp_transport import SEGMENT_PREFIX, SegmentRefused, ShmSegment, ShmTransport, segment_dir
from server_proc import MODEL, ServerProcess

# Small chunks: prompts prefill over several steps, beside other rows' decode steps.
EXACT = dict(dtype="float32", quantization=None, kv_cache_memory="64MiB", max_model_len=512,
             max_num_batched_tokens=48)
SHARED = ("You are a careful assistant for a hardware shop. Answer in one short sentence, name the part, "
          "and never invent a price. ")
PROMPTS = [SHARED + "Which cable connects a monitor?", "The capital of France is",
           SHARED + "What does a power supply do?", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three primary colors:"]
LOGPROB_TOL = 1e-4  # float32: the ranks' partial sums add in another order than one matmul's
# Weights in VNNI blocks (AVX-512 VNNI CPUs) round decode rows' x to int16 steps per group, where a
# last-bit difference now and then moves one x by a step: measured worst gap 2.3e-3, tokens equal.
VNNI_LOGPROB_TOL = 1e-2


def _smollm_like(**kw) -> ModelArchConfig:
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64)
    return ModelArchConfig(**{**base, **kw})


def test_heads_follow_their_kv_head_and_the_split_may_be_uneven():
    c = _smollm_like()
    r0, r1 = TPShard(0, 2, c), TPShard(1, 2, c)
    assert (r0.kv_heads, r0.q_heads, r1.kv_heads, r1.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (r0.mlp, r1.mlp, r0.vocab, r1.vocab) == ((0, 768), (768, 1536), (0, 24576), (24576, 49152))
    local = r1.local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.head_dim) == (3, 1, 768, 64)
    assert [even_split(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


@pytest.mark.parametrize("config, size, message", [
    (_smollm_like(), 4, "it has 3 KV head(s), and each rank needs at least one"),
    (_smollm_like(architecture="gemma3"), 2, "not supported for architecture 'gemma3'"),
])
def test_unsplittable_models_get_a_clear_error(config, size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(config, size)


def test_shards_of_packed_and_dense_weights_rebuild_the_full_weights():
    """Every weight's shards, put back together along the split axis, are the full weight: packed
    (GroupAffine: rows and group-aligned columns stay packed) and dense alike, bias included."""
    c = _smollm_like(num_layers=1, vocab_size=101, hidden_size=64, intermediate_size=96, num_heads=6,
                     num_kv_heads=3, head_dim=16)
    g = torch.Generator().manual_seed(0)

    def packed(n, k):
        return GroupAffine(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                           torch.rand(n, k // 16, generator=g), torch.rand(n, k // 16, generator=g), 16, 4)

    p = "model.layers.0."
    full = {"model.embed_tokens.weight": packed(101, 64), p + "self_attn.q_proj.weight": packed(96, 64),
            p + "self_attn.k_proj.weight": packed(48, 64), p + "self_attn.v_proj.weight": torch.rand(48, 64),
            p + "self_attn.q_proj.bias": torch.rand(96), p + "self_attn.o_proj.weight": packed(64, 96),
            p + "mlp.gate_proj.weight": torch.rand(96, 64), p + "mlp.up_proj.weight": packed(96, 64),
            p + "mlp.down_proj.weight": packed(64, 96), "model.norm.weight": torch.rand(64)}
    shards = [shard_weights(full, TPShard(r, 2, c)) for r in range(2)]

    def dense(w):
        return w.dequantize() if isinstance(w, GroupAffine) else w

    by_cols = {p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"}
    for name, w in full.items():
        if name == "model.norm.weight":
            assert all(s[name] is w for s in shards)  # replicated
            continue
        parts = [dense(s[name]) for s in shards]
        assert torch.equal(torch.cat(parts, dim=1 if name in by_cols else 0), dense(w)), name
        assert all(isinstance(s[name], GroupAffine) == isinstance(w, GroupAffine) for s in shards), name


def test_step_plans_and_the_config_reach_the_workers_unchanged():
    """What rank 0 sends a worker (a plan as msgpack, the config as JSON) decodes to what the
    runner and the engine read: every field, with KV cache groups, released blocks (read_index),
    prompt logprobs, block copies and sink re-rotations, none of which the parity runs carry."""
    from kvshare.config import EngineConfig
    from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan
    from kvshare.engine.tensor_parallel import _decode, _encode, config_from_json, config_to_json

    import msgpack

    plan = StepPlan(
        chunks=[ChunkPlan("req-1#0", 40, [7], 36, (GroupAccess([645], [3, 9], [0, 2]), GroupAccess([81], [5], None)),
                          True, None),
                ChunkPlan("req-2", 0, [1, 2, 3], 0, (GroupAccess([16, 17, 18], [1], None),), False, (0, 2))],
        block_copies=[(4, 11)], rotations=[("req-1#0", [3, 9], -16)])
    got = _decode(msgpack.unpackb(msgpack.packb(_encode(plan))))
    want = plan.chunks  # plain data (sequence ids, not records): every field travels
    assert got.chunks == want and got.block_copies == plan.block_copies and got.rotations == plan.rotations
    assert got.chunks[1].prompt_logits == (0, 2) and isinstance(got.chunks[0].kv[1], GroupAccess)
    assert got.logit_rows()[0] == plan.logit_rows()[0]  # the rows whose logits rank 0 needs
    for cfg in (EngineConfig(), EngineConfig(dtype="bfloat16", quantization=None, kv_cache_memory="96MiB",
                                             kv_policy="sink", window_tokens=64, kv_cache_dtype="bfloat16",
                                             prefix_caching_hash_seed="s", tensor_parallel_size=2, num_threads=2)):
        assert config_from_json(config_to_json(cfg).encode()) == cfg


def test_doctor_refuses_tensor_parallel_by_name():
    from kvshare.config import EngineConfig
    from kvshare.doctor import DoctorUsageError
    from kvshare.doctor_target import InProcessTarget

    with pytest.raises(DoctorUsageError, match="--tensor-parallel-size 2 is not supported by kvshare doctor"):
        InProcessTarget(EngineConfig(tensor_parallel_size=2))


def _ranks(size: int, slot_bytes: int, work) -> list:
    """work(transport) on `size` ranks at once (threads of this process over one segment)."""
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        f"kvshare-test-{os.getpid()}-{time.monotonic_ns()}")
    segs = [ShmSegment(path, size, slot_bytes, create=True)]
    try:
        segs += [ShmSegment(path, size, slot_bytes, create=False) for _ in range(1, size)]
    finally:
        os.unlink(path)
    results: list = [None] * size

    def run(r):
        results[r] = work(ShmTransport(segs[r], r, lambda late: None))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_collectives_sum_gather_and_broadcast_like_the_reference(size):
    assert shm.SHM.wait_until_built(timeout=600), shm.SHM.unavailable_reason()
    slot = 4096  # small slots: every operation below also runs in several pieces
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(40, 33, generator=g) for _ in range(size)]  # 5280 bytes: two pieces
    bs = [torch.randn(3000, generator=g).to(torch.bfloat16) for _ in range(size)]
    message = bytes(range(256)) * 40  # 10240 bytes: three pieces with the length header

    def work(t):
        rank = t.rank
        out = {"sum": t.all_reduce_(xs[rank].clone()), "bf16": t.all_reduce_(bs[rank].clone())}
        out["gather"] = t.gather0(xs[rank] * 2)
        out["bytes"] = t.broadcast0(message if rank == 0 else None)
        out["empty"] = t.broadcast0(b"" if rank == 0 else None)
        for _ in range(50):  # many more operations: both banks reused over and over
            out["last"] = t.all_reduce_(torch.full((7,), float(rank + 1)))
        return out

    results = _ranks(size, slot, work)
    want_sum = xs[0].clone()
    for x in xs[1:]:
        want_sum += x
    want_bf16 = sum(b.float() for b in bs).to(torch.bfloat16)
    for r, out in enumerate(results):
        assert torch.equal(out["sum"], want_sum)  # the same bits on every rank, in rank order
        assert torch.equal(out["bf16"], want_bf16)
        assert out["bytes"] == message and out["empty"] == b""
        assert torch.equal(out["last"], torch.full((7,), float(sum(range(1, size + 1)))))
        if r == 0:
            assert all(torch.equal(got, x * 2) for got, x in zip(out["gather"], xs))
        else:
            assert out["gather"] is None


# Both modes with float32 everywhere, so TP=2 must match TP=1 to 1e-4: the exact mode (dequantized
# weights, the step-by-step forward) and the weights kept quantized with float32 prefill GEMMs
# (packed shards; decode steps take the fused C++ step, which all-reduces in C++).
MODES = {"exact": EXACT, "quantized": dict(EXACT, quantization="auto", prefill_dtype="float32")}


@pytest.fixture(scope="module")
def engines():
    # Built, not still building: `auto` would take gloo and the step-by-step path otherwise.
    for lib in (shm.SHM, decode_step.DECODE, qmatmul.QMATMUL):
        assert lib.wait_until_built(timeout=900), lib.unavailable_reason()
    made = {"exact": LLM(**EXACT), "quantized": LLM(**MODES["quantized"]),
            ("exact", "shared memory"): LLM(tensor_parallel_size=2, **EXACT),
            ("quantized", "shared memory"): LLM(tensor_parallel_size=2, **MODES["quantized"]),
            ("quantized", "gloo"): LLM(tensor_parallel_size=2, tensor_parallel_backend="gloo", **MODES["quantized"])}
    yield made
    for key, llm in made.items():
        if isinstance(key, tuple):
            llm.engine.close()


def _close(a: dict, b: dict, tol: float = LOGPROB_TOL) -> bool:
    return a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= tol for t in a)


@pytest.mark.parametrize("mode, backend", [("exact", "shared memory"), ("quantized", "shared memory"),
                                           ("quantized", "gloo")])
def test_tp2_matches_tp1_in_float32(engines, mode, backend):
    ref, tp = engines[mode], engines[(mode, backend)]
    assert tp.engine.startup.tp_transport == backend
    fused = tp.engine.model.fused_decode
    fused_steps = []
    run = fused.run
    fused.run = lambda *a: fused_steps.append(1) or run(*a)
    # Round 2 hits the prefix cache (the shared system prompt's blocks and whole earlier prompts);
    # round 1 asks for prompt logprobs too (such a request computes its whole prompt).
    rounds = [SamplingParams(temperature=0, max_tokens=32, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=32, logprobs=3)]
    prompts = PROMPTS
    tol = VNNI_LOGPROB_TOL if ref.engine.model.layers[0].qkv.blocks is not None else LOGPROB_TOL
    if backend == "gloo":  # the fallback, ~1.5 ms per all-reduce here: a lighter run of the same checks
        prompts, rounds = PROMPTS[:2], rounds[:1]
    try:
        for round_, sp in enumerate(rounds):
            want, got = ref.generate(prompts, sp, use_tqdm=False), tp.generate(prompts, sp, use_tqdm=False)
            for w, o in zip(want, got):
                assert o.outputs[0].token_ids == w.outputs[0].token_ids, (round_, w.prompt)
                assert all(_close(a, b, tol) for a, b in zip(w.outputs[0].logprobs, o.outputs[0].logprobs)), \
                    (round_, w.prompt)
                if sp.prompt_logprobs:
                    assert o.prompt_logprobs[0] is None and all(
                        _close(a, b, tol) for a, b in zip(w.prompt_logprobs[1:], o.prompt_logprobs[1:])), (round_, w.prompt)
                assert o.num_cached_tokens == w.num_cached_tokens
    finally:
        fused.run = run
    if len(rounds) == 2:
        assert [o.num_cached_tokens > 0 for o in got] == [p.startswith(SHARED) for p in prompts]
    assert tp.engine.manager.num_used_blocks() == ref.engine.manager.num_used_blocks()
    # Which forward ran the decode steps: the fused C++ step only with weights on group kernels
    # and the shared memory transport.
    assert bool(fused_steps) == (mode == "quantized" and backend == "shared memory")


def test_rank0_holds_its_shard_and_says_so(engines):
    ref, tp = engines["exact"], engines[("exact", "shared memory")]
    assert tp.engine.kv_cache.data.shape[2] == 2 and ref.engine.kv_cache.data.shape[2] == 3  # KV heads
    assert tp.engine.model.layers[0].o.in_features == 6 * 64
    line = next(s for s in tp.engine.startup.lines() if "tensor parallel" in s)
    assert "2 ranks over shared memory" in line and "query heads 0-5, KV heads 0-1" in line
    # The fused decode step all-reduces through shared memory in C++; over gloo it cannot.
    assert engines[("quantized", "shared memory")].engine.model.fused_decode.model_reason is None
    assert engines[("quantized", "gloo")].engine.model.fused_decode.model_reason.startswith("tensor parallel over gloo")


def test_bfloat16_ranks_agree_whether_they_step_fused_or_layer_by_layer():
    """bfloat16 activations: the C++ step exchanges bfloat16 pieces as the Python transport does,
    so rank 0 going layer by layer while rank 1 stays fused still pairs every message. A mismatch
    would sum plan bytes or misaligned pieces into the activations: garbage logits, every prompt
    off from its first token. What is left is bfloat16 rounding: on one rank, fused against layer
    by layer on these 6 prompts, 5 decode identically and the worst chosen-token logprob gap is
    0.12 (measured); with 2 ranks each rank's partial sum is rounded too: 5 and 0.15 (measured).
    Hence at most 2 prompts may differ and gaps stay under 0.3, far below garbage."""
    llm = LLM(tensor_parallel_size=2, dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    try:
        fused = llm.engine.model.fused_decode
        prompts = [{"prompt_token_ids": p}
                   for p in english_token_prompts(llm.get_tokenizer().encode, [12, 40, 90, 150, 200, 260])]
        sp = SamplingParams(temperature=0, max_tokens=32, logprobs=1)
        calls = []
        run = fused.run
        fused.run = lambda *a: calls.append(1) or run(*a)
        both_fused = llm.generate(prompts, sp, use_tqdm=False)
        assert calls, "rank 0 never took the fused step"
        fused.enabled = False
        rank0_layers = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.engine.close()
    identical, gap = greedy_agreement(both_fused, rank0_layers)
    assert identical >= len(prompts) - 2 and gap <= 0.3, (identical, gap)


def test_a_step_that_fails_part_way_stops_the_engine_rather_than_desynchronize():
    """Rank 0 fails after the plan went out, its worker mid-step: the next message would pair
    with the wrong operation, so the engine stops its workers and refuses to step again."""
    llm = LLM(tensor_parallel_size=2, **EXACT)
    runner = llm.engine.runner
    procs = runner.launcher.procs
    real = runner.runner.execute

    def fail_after_embedding(plan):
        llm.engine.model.tp.all_reduce(torch.zeros(plan.num_tokens, 576))  # the worker's embedding all-reduce
        raise RuntimeError("injected")

    runner.runner.execute = fail_after_embedding
    with pytest.raises(RuntimeError, match="a step failed part-way .*injected"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    runner.runner.execute = real
    assert all(p.poll() is not None for p in procs)  # stopped, not left waiting mid-step
    with pytest.raises(RuntimeError, match="the engine cannot step: a step failed part-way"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.close()


def _worker_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "kvshare.engine.tp_worker"], capture_output=True,
                         text=True)
    return [int(x) for x in out.stdout.split()]


def test_a_dead_worker_fails_the_next_step_with_its_name():
    llm = LLM(tensor_parallel_size=2, **EXACT)
    procs = llm.engine.runner.launcher.procs
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor parallel: the engine cannot step: worker rank 1 \(exit code -9\) "
                                           r"is gone"):
        llm.generate(["Hello there"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - t0 < 30  # it fails; it does not wait on the dead rank
    llm.engine.close()  # and closing after that neither hangs nor raises
    assert procs[0].pid not in _worker_pids(os.getpid())


def test_a_killed_rank0_takes_its_worker_with_it(tmp_path):
    script = textwrap.dedent("""
        import sys
        from kvshare import LLM, SamplingParams
        llm = LLM(tensor_parallel_size=2, kv_cache_memory="32MiB", max_model_len=256)
        llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)
        print(llm.engine.runner.launcher.procs[0].pid, flush=True)
        sys.stdin.read()
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    worker = int(rank0.stdout.readline())
    rank0.kill()
    rank0.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not _alive(worker):
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    pytest.fail(f"worker {worker} outlived its killed rank 0 by 20 s")


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes hold open in the listening state."""
    found = set()
    for pid in pids:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                        continue
                    addr, port = cols[1].split(":")
                    raw = bytes.fromhex(addr)  # 32-bit words in host (little endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback


def test_gloo_ranks_listen_on_loopback_alone_and_no_store_outlives_start_up(engines):
    """Over gloo, the ranks' own sockets (gloo keeps a listener per rank for the group's life) are
    on loopback, and the start-up store is gone once the engines run: before issue 33 each engine
    kept a TCPStore listening on every interface."""
    tp = [llm for key, llm in engines.items() if isinstance(key, tuple)]
    gloo = engines[("quantized", "gloo")]
    pids = [os.getpid()] + [p.pid for p in gloo.engine.runner.launcher.procs]
    listening = _listening(pids)
    assert listening and all(_loopback(addr) for addr, _ in listening), listening
    for llm in tp:
        assert not os.path.exists(llm.engine.runner.launcher.store_dir)
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"kvshare-tp-store-{os.getpid()}-")]


def test_the_store_is_its_users_alone_and_goes_with_a_start_up_that_ends_early():
    """The store's directory is mode 0700 and removed when start-up ends before the ranks connect
    (the engine's failure path); the token reaches the worker in its environment, never on its
    command line, which every user can read."""
    from kvshare.config import EngineConfig
    from kvshare.engine.tensor_parallel import TOKEN_ENV, TensorParallelLauncher

    launcher = TensorParallelLauncher(EngineConfig(tensor_parallel_size=2, kv_cache_memory="32MiB"))
    try:
        assert os.stat(launcher.store_dir).st_mode & 0o777 == 0o700
        pid = launcher.procs[0].pid
        deadline = time.monotonic() + 30
        while not (cmdline := _read(f"/proc/{pid}/cmdline")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the child is not yet the worker (its exec has not finished)
        environ = dict(v.split(b"=", 1) for v in _read(f"/proc/{pid}/environ").split(b"\0") if b"=" in v)
        token = environ[TOKEN_ENV.encode()]
        assert b"kvshare.engine.tp_worker" in cmdline and len(token) == 64 and token not in cmdline
    finally:
        launcher.close(None)
    assert not os.path.exists(launcher.store_dir) and all(p.poll() is not None for p in launcher.procs)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _segment_spec(path: str, slot_bytes: int) -> bytes:
    return json.dumps({"path": path, "slot_bytes": slot_bytes}).encode()


def test_a_worker_maps_only_a_segment_its_engine_could_have_made(tmp_path):
    """The path and slot size a worker is told must be what rank 0 makes and what the worker
    computes itself: otherwise a clear error, and nothing is mapped (a symbolic link's target
    stays untouched)."""
    from kvshare.engine.tp_worker import map_segment

    assert shm.SHM.wait_until_built(timeout=600), shm.SHM.unavailable_reason()
    base, slot = segment_dir(), ShmSegment.slot_bytes_for(48, 576)
    nbytes = 4096 + 2 * 2 * slot
    name = f"{SEGMENT_PREFIX}test-{os.getpid()}-{time.monotonic_ns()}"
    good, link, small = (os.path.join(base, name + suffix) for suffix in ("", "-link", "-small"))
    victim = tmp_path / "victim"
    victim.write_bytes(b"\x7f" * nbytes)
    os.symlink(victim, link)
    with open(small, "wb") as f:
        f.write(b"\0" * 4096)
    made = ShmSegment(good, 2, slot, create=True)
    try:
        assert map_segment(_segment_spec(good, slot), 2, slot).slot_bytes == slot  # the engine's own: mapped
        refused = {
            str(tmp_path / name): "is not a kvshare-tp-\\* file directly in",  # another directory
            os.path.join(base, "kvshare-test-x"): "is not a kvshare-tp-\\* file",  # another prefix
            os.path.join(base, name, "..", name): "is not a kvshare-tp-\\* file",  # dot segments
            link: "is a symbolic link",
            small: f"has 4096 bytes, not the {nbytes} this rank expects",
        }
        for path, message in refused.items():
            with pytest.raises(SegmentRefused, match=message):
                map_segment(_segment_spec(path, slot), 2, slot)
        with pytest.raises(ValueError, match=f"slot_bytes {2 * slot} is not the {slot} this rank computes"):
            map_segment(_segment_spec(good, 2 * slot), 2, slot)
        assert map_segment(b"", 2, slot) is None  # rank 0 made none: gloo
    finally:
        for path in (good, link, small):
            os.unlink(path)
    assert victim.read_bytes() == b"\x7f" * nbytes


def test_a_worker_takes_only_the_kv_pool_size_it_would_have_planned():
    from kvshare.config import EngineConfig
    from kvshare.engine.model_setup import plan_kv
    from kvshare.engine.tp_worker import check_num_blocks
    from kvshare.memory_plan import kv_pool_blocks

    mc = _smollm_like()
    fixed = EngineConfig(kv_cache_memory="64MiB", max_model_len=512)
    kv = plan_kv(fixed, mc)
    per_token = fixed.kv_format.bytes_per_token(kv.layers_per_block, mc.num_kv_heads, mc.head_dim)
    want = kv_pool_blocks(fixed.kv_budget_bytes(), per_token, fixed.block_size)
    assert check_num_blocks(want, fixed, mc, kv) == want
    with pytest.raises(ValueError, match=f"a KV pool of {want + 1} blocks is not the {want} that kv_cache_memory="):
        check_num_blocks(want + 1, fixed, mc, kv)
    # A fraction of the memory free when rank 0 planned: any size this machine can hold.
    share = EngineConfig(max_model_len=512)
    assert check_num_blocks(want, share, mc, kv) == want
    for bad in (0, -1, 2**50):
        with pytest.raises(ValueError, match="is not between one block and this machine's memory"):
            check_num_blocks(bad, share, mc, kv)


def test_start_up_values_count_only_when_signed_with_the_launch_token(tmp_path):
    """Either side refuses a value another token signed, an unsigned one (a forged ready key) and
    a signed value moved under another key."""
    from kvshare.engine.tensor_parallel import SignedStore, open_store

    raw = open_store(str(tmp_path / "store"), 2)
    ours, theirs = SignedStore(raw, "a" * 64), SignedStore(raw, "b" * 64)
    ours.set("config", '{"model": "mine"}')
    assert ours.get("config") == b'{"model": "mine"}'
    with pytest.raises(RuntimeError, match="the start-up store's 'config' is not signed with this launch's token"):
        theirs.get("config")
    raw.set("ready/1", "1")
    raw.set("num_blocks", raw.get("config"))
    for key in ("ready/1", "num_blocks"):
        with pytest.raises(RuntimeError, match=f"'{key}' is not signed"):
            ours.get(key)


def test_a_worker_without_the_launch_token_refuses_to_start(tmp_path):
    """A worker started by hand (no token in its environment) or with another launch's token
    stops before it reads the config's model, and signs nothing."""
    from kvshare.config import EngineConfig
    from kvshare.engine.tensor_parallel import TOKEN_ENV, SignedStore, config_to_json, open_store

    path = str(tmp_path / "store")
    raw = open_store(path, 2)
    SignedStore(raw, "a" * 64).set("config", config_to_json(EngineConfig(model=str(tmp_path / "never-loaded"),
                                                                         tensor_parallel_size=2)))
    cmd = [sys.executable, "-m", "kvshare.engine.tp_worker", "--rank", "1", "--size", "2", "--store", path,
           "--threads", "1", "--parent", str(os.getpid())]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    for token, message in ((None, f"{TOKEN_ENV} is not set: a worker is started by its engine"),
                           ("b" * 64, "the start-up store's 'config' is not signed with this launch's token")):
        run = subprocess.run(cmd, env=env if token is None else dict(env, **{TOKEN_ENV: token}),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
        assert "never-loaded" not in run.stderr
    assert os.path.exists(path) and not raw.check(["shm/1"]) and not raw.check(["ready/1"])


def test_serve_with_tensor_parallel_answers_like_tp1_and_listens_on_its_port_alone():
    """The default mode (weights kept quantized: packed shards) behind the OpenAI server. The
    server and its worker listen on the HTTP port and nothing else (before issue 33 the start-up
    TCPStore listened on every interface for the engine's life)."""
    prompt = "The three largest planets are"
    ref = LLM(kv_cache_memory="64MiB", max_model_len=512)
    want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess("--tensor-parallel-size", "2").wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        assert "tensor parallel: 2 ranks over shared memory" in srv.log_text()
        workers = _worker_pids(srv.proc.pid)
        assert len(workers) == 1
        assert _listening([srv.proc.pid, *workers]) == {("127.0.0.1", srv.port)}
        assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"kvshare-tp-store-{srv.proc.pid}-")]
        assert srv.terminate() == 0  # SIGTERM: drained, workers stopped, exit 0
    finally:
        srv.close()
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
