"""A row's arithmetic is chosen by the row (issue 27): its kind (decode or prompt), the mode and its
own shape, never by what else shares its step. In the default mode a decode row takes the fused
C++ decode stack whether or not a prompt is being prefilled beside it, or a row whose window hides
keys decodes beside it, so its logprobs are the same bits either way; on the PyTorch attention
path a decode row is padded to a width of its own length, whatever its neighbours."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import english_token_prompts
from kvshare import LLM, SamplingParams
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan
from kvshare.kvcache.kv_policy import FullAttention
from kvshare.model.attention import PagedKVStorage, TorchPagedAttention
from kvshare.model.config import ModelArchConfig

STEPS = 12


def _decode_logprobs(llm: LLM, first: list[int], second: list[int] | None, join_after: int) -> list[float]:
    """Chosen-token logprobs of `first`, run alone or with `second` arriving after `join_after` steps
    (while `first` decodes, so its prompt is prefilled in chunks beside `first`'s decode rows)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    engine.add_request("first", {"prompt_token_ids": first}, params)
    final = None
    steps = 0
    while engine.has_unfinished_requests():
        if second is not None and steps == join_after:
            engine.add_request("second", {"prompt_token_ids": second}, params)
        for out in engine.step():
            if out.request_id == "first" and out.finished:
                final = out.outputs[0]
        steps += 1
    return [final.logprobs[i][t].logprob for i, t in enumerate(final.token_ids)]


def test_a_decode_rows_logprobs_do_not_depend_on_a_prompt_sharing_its_step():
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=24)
    assert llm.engine.model.fused_decode.model_reason is None  # the default mode's fused decode stack
    first, second = english_token_prompts(llm.get_tokenizer().encode, [9, 90])
    alone = _decode_logprobs(llm, first, None, 0)
    # The second prompt (90 tokens, 24 a step) is prefilled over four steps while the first decodes.
    together = _decode_logprobs(llm, first, second, 3)
    assert together == alone


def _logprobs_joining(llm: LLM, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[float]]:
    """Chosen-token logprobs of each request (prompt ids, the step before which it is added)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    out: dict[str, list[float]] = {}
    steps = 0
    while len(out) < len(prompts):
        for rid, (ids, join) in prompts.items():
            if join == steps:
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        steps += 1
    return out


def test_a_decode_rows_path_does_not_depend_on_a_windowed_row_beside_it():
    """Attention sinks on the bundled model: a short row still sees every earlier key, a long row's
    window hides keys; both take the fused stack (each row with its own visible range), alone or
    side by side. Each row's logprobs are the same bits alone and together."""
    sinks, window, block = 4, 32, 16
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, block_size=block, kv_policy="sink",
              sink_tokens=sinks, window_tokens=window)
    assert llm.engine.model.fused_decode.model_reason is None  # the default mode's fused decode stack
    short, long = english_token_prompts(llm.get_tokenizer().encode, [9, 90])
    plain_until = window + block - 1  # keys a query sees before its window leaves block 0 behind
    assert len(short) + STEPS <= plain_until < len(long)
    short_alone = _logprobs_joining(llm, {"short": (short, 0)})["short"]
    long_alone = _logprobs_joining(llm, {"long": (long, 0)})["long"]
    # The long prompt is prefilled while the short one decodes (a prompt beside a decode row: the
    # case above); from the next step both decode side by side.
    together = _logprobs_joining(llm, {"short": (short, 0), "long": (long, 1)})
    assert together["short"] == short_alone
    assert together["long"] == long_alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rows_padding_and_output_on_the_pytorch_path_are_its_own(dtype):
    """The PyTorch attention path (no C++ kernel, or soft-capping) pads decode rows into groups:
    each row is padded to a width of its own length, never to a longer neighbour's, and its output
    is the same bits alone and in a batch of rows of other lengths (model-free)."""
    bs, kv_heads, group, head_dim = 16, 3, 3, 64
    ctx_lens = [7, 20, 40, 100, 135, 150, 300, 700]  # sorted, as the scheduler sends decode rows
    blocks = [-(-n // bs) for n in ctx_lens]
    kv_cache = PagedKVStorage(1, sum(blocks), bs, kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(0)
    kv_cache.data.copy_(torch.randn(kv_cache.data.shape, generator=g).to(dtype))
    rows, first = [], 0
    for r, (n, b) in enumerate(zip(ctx_lens, blocks)):
        table = list(range(first, first + b))[::-1]  # any block ids: the table says where each is
        first += b
        slot = table[(n - 1) // bs] * bs + (n - 1) % bs
        rows.append(ChunkPlan(f"s{r}", n - 1, [1], n - 1, (GroupAccess([slot], table, None),), samples=True))
    q = torch.randn(len(rows), kv_heads * group, head_dim, generator=g).to(dtype)
    k = torch.randn(len(rows), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(len(rows), kv_heads, head_dim, generator=g).to(dtype)
    backend = TorchPagedAttention(bs, use_cpp_kernel=False)
    arch = ModelArchConfig("llama", 320, kv_heads * group * head_dim, 128, 1, kv_heads * group, kv_heads, head_dim)
    runner = ModelRunner(SimpleNamespace(config=arch, backend=backend), kv_cache, [FullAttention(bs)], [0], [0])

    def attend(picked: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The rows' attention output and the width each row's keys are padded to."""
        meta = runner.prepare(StepPlan(chunks=[rows[i] for i in picked]))[2]
        widths = [grp.block_tables.shape[1] for grp in meta.decode_groups for _ in range(grp.num_rows)]
        out = backend.forward(q[picked], k[picked], v[picked], *kv_cache.layer(0), meta, head_dim ** -0.5)
        return out, widths

    together, widths = attend(list(range(len(rows))))
    for i in range(len(rows)):
        alone, [width] = attend([i])
        assert widths[i] == width >= blocks[i]
        assert torch.equal(together[i], alone[0]), f"row {i} ({ctx_lens[i]} keys)"
