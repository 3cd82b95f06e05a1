"""The offline API, shaped like vLLM's: LLM(...).generate(...) and LLM(...).chat(...)."""
from __future__ import annotations

import dataclasses
import sys
from typing import Sequence as Seq

from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.beam_search import BeamSearchParams
from kvshare.errors import InvalidRequestError
from kvshare.lora_request import LoRARequest
from kvshare.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvshare.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = LLMEngine(self.config)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`priority` (vLLM's): one per prompt, under --scheduling-policy priority (lower first); it
        overrides the params' own. `lora_request` (vLLM's): one adapter for every prompt, or one
        (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts: "
                    "give one SamplingParams or one per prompt"
                )
        if priority is not None:
            if isinstance(priority, (int, str)) or len(priority) != len(prompts):
                raise InvalidRequestError(f"priority={priority!r} is invalid: must be a list of one integer per "
                                          f"prompt ({len(prompts)})", "priority")
            params_list = [dataclasses.replace(p, priority=q) for p, q in zip(params_list, priority)]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidRequestError(f"lora_request has {len(loras)} entries but there are {len(prompts)} "
                                          f"prompts: give one LoRARequest or one per prompt", "lora_request")
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(self._next_id(), prompt, params, lora_request=lora))
        except Exception:
            # A bad prompt in the list must not leave its siblings running in the engine.
            self.engine.abort_request(ids)
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search; beams share KV blocks and fork with copy-on-write. `lora_request` as
        generate's (vLLM's): one adapter for every prompt, or one (or None) per prompt; every beam
        of a prompt runs under its adapter."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        outs = self.generate(list(prompts), [params] * len(prompts), use_tqdm=use_tqdm, lora_request=lora_request)
        tok = self.engine.tokenizer
        results = []
        for out in outs:
            seqs = []
            for c, score in zip(out.outputs, out.extra["beam_scores"]):
                tokens = list(out.prompt_token_ids) + list(c.token_ids)
                text = tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""
                seqs.append(BeamSearchSequence(tokens, text, c.cumulative_logprob, score, c.finish_reason))
            results.append(BeamSearchOutput(seqs))
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so chat() cannot apply a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": tok.encode(tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt),
                                            add_special_tokens=False)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", file=sys.stderr, dynamic_ncols=True)
        wanted = set(ids)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
