"""Per-step Python time at batch 64: engine.step() wall time minus model.forward + compute_logits
(scheduling, the step plan, tensors from it, sampling, detokenizing, outputs), median of 30 decode
steps after 64 prompts of 100-415 tokens are prefilled.

    python benchmarks/step_python.py default      # kept-quantized GGUF weights
    python benchmarks/step_python.py float32      # dequantized float32
    PYTHONPATH=<other tree> python benchmarks/step_python.py default   # the same on another checkout
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # run from a checkout's root
from helpers import english_token_prompts
from kvshare import LLM, SamplingParams
from kvshare.model.kernels import decode_step, qmatmul
decode_step.DECODE.wait_until_built(); qmatmul.QMATMUL.wait_until_built()
dtype = sys.argv[1] if len(sys.argv) > 1 else "default"
kw = {} if dtype == "default" else {"dtype": dtype, "quantization": None}
llm = LLM(kv_cache_memory="1GiB", enable_prefix_caching=False, **kw)
eng = llm.engine; tok = llm.get_tokenizer(); model = eng.model
B = 64
prompts = english_token_prompts(tok.encode, [100 + 5 * i for i in range(B)])
sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
for i, p in enumerate(prompts):
    eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
while any(s.num_computed_tokens < s.num_prompt_tokens for st in eng.requests.values() for s in st.seqs):
    eng.step()
acc = [0.0]
for name in ("forward", "compute_logits"):
    f = getattr(model, name)
    def w(*a, _f=f, **k):
        t = time.perf_counter(); r = _f(*a, **k); acc[0] += time.perf_counter() - t; return r
    setattr(model, name, w)
steps, model_t = [], []
for _ in range(30):
    acc[0] = 0.0
    t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t); model_t.append(acc[0])
py = [s - m for s, m in zip(steps, model_t)]
print(f"{dtype}: batch {B} step {statistics.median(steps)*1e3:.1f} ms, model {statistics.median(model_t)*1e3:.1f} ms, "
      f"python (rest) {statistics.median(py)*1e3:.2f} ms")
