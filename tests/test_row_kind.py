"""A row's arithmetic is chosen by the row (issue 27): its kind (decode or prompt), the mode and its
own shape, never by what else shares its step. In the default mode a decode row takes the fused
C++ decode stack whether or not a prompt is being prefilled beside it, so its logprobs are the
same bits either way."""
from __future__ import annotations

from helpers import english_token_prompts
from kvshare import LLM, SamplingParams

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
