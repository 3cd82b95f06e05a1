"""LLMEngine: add_request / abort_request / step, the loop the offline API, the server and
the doctor all drive."""
from __future__ import annotations

import ctypes
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from kvshare.config import EngineConfig
from kvshare.engine.beam_search import BeamSearchParams, BeamState
from kvshare.engine.detokenizer import IncrementalDetokenizer
from kvshare.engine.model_runner import ModelRunner, StepLogits
from kvshare.engine.request import Sequence, SeqStatus
from kvshare.engine.scheduler import Scheduler
from kvshare.errors import InvalidRequestError
from kvshare.kvcache.audit import KVAuditor, record_step_io
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.kv_policy import build_kv_policy
from kvshare.kvcache.manager import KVCacheManager
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model import cpu_kernels
from kvshare.model.attention import KVCache, TorchPagedAttention
from kvshare.model.llama import build_model
from kvshare.model.loader import load_model
from kvshare.model.sampler import Sampler, SamplingRow, logprobs_of
from kvshare.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvshare.sampling_params import SamplingParams

logger = logging.getLogger("kvshare")

# vLLM's TextPrompt / TokensPrompt keys that a text-only engine can honour, and the multimodal
# ones it must refuse by name.
PROMPT_DICT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
MULTIMODAL_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


def _agreed_salt(from_prompt: str | None, from_params: str | None) -> str | None:
    """The request's tenant salt: given in the prompt dict, in SamplingParams, or in both alike."""
    if from_prompt is not None and from_params is not None and from_prompt != from_params:
        raise InvalidRequestError(
            f"cache_salt differs between the prompt dict ({from_prompt!r}) and SamplingParams "
            f"({from_params!r}): give it once, or the same in both", "cache_salt")
    return from_prompt if from_prompt is not None else from_params


@dataclass
class KVLayout:
    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    dtype: str

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @property
    def max_len_seqs(self) -> float:
        return self.num_slots / self.max_model_len

    def describe(self) -> str:
        return (
            f"KV cache: {self.bytes_per_token} bytes/token ({self.dtype}), {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.num_slots} token slots ({self.pool_bytes / 2**20:.1f} MiB); "
            f"{self.max_len_seqs:.2f} sequences of max_model_len={self.max_model_len} fit"
        )


@dataclass
class EngineStats:
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputes count)
    decode_tokens_computed: int = 0
    peak_blocks_in_use: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    finished: bool = False
    prompt_logprobs_owner: Sequence | None = None
    reported_final: bool = False
    beam: BeamState | None = None
    next_index: int = 1


def _release_freed_heap() -> None:
    """glibc keeps freed heap pages (here: the GGUF conversion's temporaries, tens of MB) as
    RSS until asked to return them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


@dataclass
class StartupReport:
    """The start-up block: what was loaded, how it is stored and run, and how long it took."""

    source: str
    tensor_types: dict[str, str]
    model: object
    config: EngineConfig
    layout: KVLayout
    load_seconds: float
    ready_seconds: float

    def format_mix(self) -> dict[str, int]:
        mix: dict[str, int] = {}
        for t in self.tensor_types.values():
            mix[t] = mix.get(t, 0) + 1
        return dict(sorted(mix.items(), key=lambda kv: -kv[1]))

    def weight_bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lin in self.model.linears():
            out[lin.kind] = out.get(lin.kind, 0) + lin.nbytes
        return out

    def kernels(self) -> list[str]:
        names = {"int4": "int4 packed (torch _weight_int4pack_mm_for_cpu)",
                 "int8-group": "int8 per-group (kvshare C++ qmatmul)",
                 "int4-group": "int4 per-group (kvshare C++ qmatmul)", "dense": "dense (F.linear)"}
        counts: dict[str, int] = {}
        for lin in self.model.linears():
            counts[lin.kind] = counts.get(lin.kind, 0) + 1
        out = [f"{names.get(k, k)} x{n}" for k, n in counts.items()]
        backend = self.model.backend
        out.append("decode attention: " + ("kvshare C++ paged kernel" if getattr(backend, "use_cpp_kernel", False)
                                           else "PyTorch (C++ kernel not built yet or unavailable)"))
        fused = getattr(self.model, "fused_decode", None)
        if fused is not None:
            why = fused.model_reason or (None if cpu_kernels.DECODE.available() else "C++ library not built yet")
            out.append("decode steps: " + ("one C++ call per step (kvshare fused decode)" if why is None
                                           else f"layer by layer ({why})"))
        return out

    def lines(self) -> list[str]:
        c = self.config
        mode = ("exact (dequantized float32)" if c.exact else
                f"{'kept quantized' if c.quantization == 'auto' else 'dequantized'} weights, {c.dtype} activations")
        mix = ", ".join(f"{t} x{n}" for t, n in self.format_mix().items()) or "dense checkpoint"
        by_kind = ", ".join(f"{k} {b / 2**20:.1f} MiB" for k, b in self.weight_bytes_by_kind().items())
        return [
            f"model: {self.source}",
            f"  mode: {mode}",
            f"  tensor formats: {mix}",
            f"  resident weights: {self.model.weight_bytes / 2**20:.1f} MiB ({by_kind})",
            f"  kernels: {'; '.join(self.kernels())}",
            f"  {self.layout.describe()}",
            f"  weights loaded in {self.load_seconds:.2f} s; engine ready in {self.ready_seconds:.2f} s",
        ]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t_start = time.perf_counter()
        cpu_kernels.start_background_builds()  # a missing kernel build overlaps the load, never blocks it
        dtype = config.torch_dtype
        loaded = load_model(config.model, dtype=dtype, quantization=config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        mc = self.model_config
        # Sized by the same code as `kvshare memory` plans with (scale bytes included when quantized).
        self.kv_format = config.kv_format
        bytes_per_token = self.kv_format.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim)
        num_blocks = kv_pool_blocks(config.kv_budget_bytes(), bytes_per_token, config.block_size)
        max_model_len = config.max_model_len or mc.max_position_embeddings
        # The model's own sliding windows, or the opt-in sink policy: what bounds KV per sequence.
        self.kv_policy = build_kv_policy(config, mc, max_model_len)
        # Sink sequences keep cache positions below max_model_len whatever their length.
        self._length_unbounded = self.kv_policy is not None and self.kv_policy.generates_past_max_model_len
        self.layout = KVLayout(bytes_per_token, config.block_size, num_blocks, max_model_len, self.kv_format.name)
        self.manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                      policy=self.kv_policy)
        self.kv_cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                                self.kv_format.storage)
        self.model = build_model(mc, loaded.weights, dtype, TorchPagedAttention(config.block_size), max_model_len)
        _release_freed_heap()  # the load's temporaries: back to the OS, not kept as RSS
        self.startup = StartupReport(loaded.source, loaded.tensor_types, self.model, config,
                                     self.layout, loaded.load_seconds, time.perf_counter() - t_start)
        del loaded
        for line in self.startup.lines():
            logger.info(line)
        self.scheduler = Scheduler(config, self.manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_policy)
        self.events: EventLog | None = None
        self.auditor: KVAuditor | None = None
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = list(mc.eos_token_ids)
        self._rng = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self.step_count = 0
        self.stats = EngineStats()
        self.set_audit(config.audit, config.kv_event_log)

    def set_audit(self, audit: bool, event_log: str | None = None) -> None:
        """Attach (or detach) the event log and the auditor; only while idle, so the audit's
        shadow of written KV starts from a state it can vouch for (nothing cached)."""
        if self.has_unfinished_requests() or self.manager.tables:
            raise RuntimeError("set_audit() needs an idle engine")
        if self.events is not None:
            self.events.close()
        self.events = EventLog(path=event_log) if (audit or event_log) else None
        self.auditor = None
        if self.events is not None:
            self.manager.pool.reset_prefix_cache()
            self.events.record("pool", num_blocks=self.layout.num_blocks, block_size=self.layout.block_size,
                               prefix_caching=self.config.enable_prefix_caching)
            if audit:
                self.auditor = KVAuditor(self.manager, self.events, self._live_tokens)
        self.manager.events = self.manager.pool.events = self.events

    # ---- submission ----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids", "prompt")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        beam = None
        if isinstance(params, BeamSearchParams):
            # Beams stop themselves (EOS, length); the sequences underneath just decode.
            beam = BeamState(params, list(self.eos_token_ids))
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        text, token_ids, salt = self._resolve_prompt(prompt)
        salt = _agreed_salt(salt, params.cache_salt)
        max_tokens = self._check_lengths(token_ids, params)
        if params.max_tokens != max_tokens or params.cache_salt != salt:
            params = params.clone()
            params.max_tokens = max_tokens
            params.cache_salt = salt
        now = arrival_time if arrival_time is not None else time.monotonic()
        metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids))
        state = RequestState(request_id, text, token_ids, params, [], metrics, beam=beam)
        # n > 1: one sequence computes the prompt; the others fork off it when it samples.
        first = self._new_seq(state, 0, list(token_ids), now)
        first.pending_forks = params.n - 1
        state.seqs.append(first)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs_owner = state.seqs[0]
            state.seqs[0].prompt_logprobs = [None]
        self.requests[request_id] = state
        self.scheduler.add(first)
        return request_id

    def _new_seq(self, state: RequestState, index: int, token_ids: list[int], now: float) -> Sequence:
        params = state.params
        seq = Sequence(
            seq_id=f"{state.request_id}#{index}" if params.n > 1 or state.beam else state.request_id,
            request_id=state.request_id, index=index, token_ids=token_ids,
            num_prompt_tokens=len(state.prompt_token_ids), params=params, arrival_time=now,
        )
        seq.generator = self._generator_for(params, index)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, state.prompt_token_ids, params)
        return seq

    def _generator_for(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is not None:
            seed = params.seed + index
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    def _resolve_prompt(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache_salt from a prompt dict) for a string, a token list, or one of
        vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}, each with an optional
        "cache_salt". Any other key is an error naming it: a dropped key (a tenant's cache_salt
        above all) would silently change what the request may share."""
        salt = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_DICT_KEYS)
            if unknown:
                mm = [k for k in unknown if k in MULTIMODAL_PROMPT_KEYS]
                why = (f"{mm[0]!r} is not supported: kvshare serves text-only models" if mm
                       else f"unknown prompt key(s) {unknown}")
                raise InvalidRequestError(f"{why}; a prompt dict takes {sorted(PROMPT_DICT_KEYS)}",
                                          mm[0] if mm else unknown[0])
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or salt == ""):
                raise InvalidRequestError(f"cache_salt={salt!r} is invalid: must be a non-empty string",
                                          "cache_salt")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")  # vLLM's TokensPrompt may carry the text it came from
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}", "prompt")
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidRequestError(
                        f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}", "prompt_token_ids")
                return text, self._resolve_prompt(list(ids))[1], salt
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequestError(
                    f"a prompt dict's 'prompt' must be a string (token ids go in 'prompt_token_ids'), "
                    f"got {type(prompt).__name__}", "prompt")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty: give at least one token of text", "prompt")
            ids = self.tokenize(prompt)
            if not ids:
                raise InvalidRequestError("prompt is empty after tokenization", "prompt")
            return prompt, ids, salt
        if isinstance(prompt, (list, tuple)):
            if len(prompt) == 0:
                raise InvalidRequestError("prompt_token_ids is empty: give at least one token id", "prompt")
            vocab = self.model_config.vocab_size
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab):
                    raise InvalidRequestError(
                        f"prompt_token_ids contains {t!r}: token ids must be integers in [0, {vocab})", "prompt"
                    )
            return None, list(prompt), salt
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        n = len(token_ids)
        limit = self.layout.max_model_len
        unbounded = self._length_unbounded
        if n >= limit and not unbounded:
            raise InvalidRequestError(
                f"prompt is {n} tokens, but max_model_len is {limit}: it must be at most {limit - 1} tokens "
                f"to leave room for one output token", "prompt"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            if n >= limit:
                raise InvalidRequestError(
                    f"prompt is {n} tokens, at least max_model_len={limit}: with kv_policy='sink' give max_tokens "
                    f"explicitly (there is no default length past max_model_len)", "max_tokens")
            max_tokens = limit - n
        if n + max_tokens > limit and not unbounded:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} plus the prompt's {n} tokens is {n + max_tokens}, beyond "
                f"max_model_len={limit}: lower max_tokens to at most {limit - n}", "max_tokens"
            )
        pool = self.layout.num_slots
        needed = n + max_tokens
        bound = self.kv_policy.max_blocks_per_seq(self.config.max_num_batched_tokens) if self.kv_policy else None
        if bound is not None and bound * self.layout.block_size < needed:
            # Windowed: blocks out of every window go back as the sequence grows.
            needed = bound * self.layout.block_size
            if needed > pool:
                raise InvalidRequestError(
                    f"one sequence's window plus a prefill chunk of up to max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens} needs up to {needed} KV slots, but the whole KV pool "
                    f"holds {pool}: raise kv_cache_memory or lower max_num_batched_tokens", "max_tokens")
        if needed > pool:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {n + max_tokens} KV slots, but the "
                f"whole KV pool holds {pool}: raise kv_cache_memory or lower max_tokens", "max_tokens"
            )
        return max_tokens

    # ---- lifecycle -----------------------------------------------------------------------
    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self.requests.get(rid)
            if state is None or state.finished:
                continue  # unknown or already done: aborting twice is a no-op
            for seq in state.seqs:
                if self.events is not None and not seq.is_finished:
                    self.events.record("abort", seq=seq.seq_id)
                self._finish_seq(seq, "abort")
            self._maybe_finish_request(state)
            if self.auditor is not None:
                self.auditor.check_state()

    def has_unfinished_requests(self) -> bool:
        return any(not s.reported_final for s in self.requests.values())

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for s in self.requests.values() if not s.finished)

    def _live_tokens(self) -> dict[str, list[int]]:
        return {s.seq_id: s.token_ids for s in self.scheduler.running}

    def step(self) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        self.step_count += 1
        if self.events is not None:
            self.events.step = self.step_count
            self.events.record("step")
        sched = self.scheduler.schedule()
        if not sched.is_empty():
            now = time.monotonic()
            for c in sched.chunks:
                st = self.requests[c.seq.request_id]
                if st.metrics.first_scheduled_time is None:
                    st.metrics.first_scheduled_time = now
            record_step_io(self.manager.events, self.auditor, sched)
            logits = self.runner.execute(sched)
            stats = self.stats
            stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.manager.num_used_blocks())
            for c in sched.chunks:
                seq = c.seq
                in_prompt = max(0, min(c.end, seq.num_prompt_tokens) - c.start)
                stats.prompt_tokens_computed += in_prompt
                stats.decode_tokens_computed += c.num_tokens - in_prompt
                touched[seq.request_id] = self.requests[seq.request_id]
            self.scheduler.step_done(sched)
            self._record_prompt_logprobs(logits)
            self._sample(logits)
        if self.auditor is not None:
            self.auditor.check_state()
        if self.events is not None:
            self.events.flush()
        # Requests finished outside a step (aborts) still owe their final output.
        for st in self.requests.values():
            if st.finished and not st.reported_final:
                touched[st.request_id] = st
        outputs = [self._make_output(st) for st in touched.values()]
        for st in touched.values():
            if st.finished:
                st.reported_final = True
                del self.requests[st.request_id]
        return outputs

    def _record_prompt_logprobs(self, step: StepLogits) -> None:
        for chunk, first, logits in step.prompt_logits:
            seq = chunk.seq
            k = seq.params.prompt_logprobs
            targets = seq.token_ids[first + 1:first + 1 + logits.shape[0]]
            for res in logprobs_of(logits, targets, k):
                seq.prompt_logprobs.append(self._logprob_dict(res, k))

    def _logprob_dict(self, res, k: int) -> dict[int, Logprob]:
        d = {res.token_id: Logprob(res.logprob, res.rank, self._piece(res.token_id))}
        for rank, (tid, lp) in enumerate(zip(res.top_ids[:k], res.top_logprobs[:k]), start=1):
            if tid not in d:
                d[tid] = Logprob(lp, rank, self._piece(tid))
        return d

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _sample(self, step: StepLogits) -> None:
        if not step.sample_chunks:
            return
        seqs: list[Sequence] = []
        row_of: list[int] = []
        beam_requests: dict[str, RequestState] = {}
        for r, c in enumerate(step.sample_chunks):
            st = self.requests[c.seq.request_id]
            if st.beam is not None:
                c.seq.beam_logprobs = torch.log_softmax(step.sample_logits[r].float(), dim=-1)
                beam_requests[st.request_id] = st
                continue
            seqs.append(c.seq)
            row_of.append(r)
            if c.seq.pending_forks:
                # The prompt is computed once; each fork draws its own first token from it.
                for child in self._fork(c.seq):
                    seqs.append(child)
                    row_of.append(r)
        now = time.monotonic()
        if seqs:
            logits = step.sample_logits
            if row_of != list(range(logits.shape[0])):
                logits = logits[torch.tensor(row_of)]
            rows = [
                SamplingRow(s.params, s.generator, s.token_ids[:s.num_prompt_tokens], s.output_token_ids,
                            self.eos_token_ids)
                for s in seqs
            ]
            for seq, res in zip(seqs, self.sampler(logits, rows)):
                self._append_token(seq, res, now)
        for st in beam_requests.values():
            self._beam_step(st, now)

    def _beam_step(self, st: RequestState, now: float) -> None:
        live = [s for s in st.seqs if not s.is_finished]
        if any(s.beam_logprobs is None for s in live):
            return  # a sibling was preempted or not scheduled: wait until every beam has its logits
        if st.metrics.first_token_time is None:
            st.metrics.first_token_time = now
            st.metrics.time_to_first_token = now - st.metrics.arrival_time
        plan = st.beam.update([s.beam_score for s in live], torch.stack([s.beam_logprobs for s in live]),
                              [s.output_token_ids for s in live])
        for s in live:
            s.beam_logprobs = None
        if st.beam.done:
            for s in live:
                self._finish_seq(s, "length")
            self._maybe_finish_request(st)
            return
        by_parent: dict[int, list] = {}
        for cont in plan:
            by_parent.setdefault(cont.parent, []).append(cont)
        for i, parent in enumerate(live):
            conts = by_parent.get(i)
            if not conts:
                self._finish_seq(parent, "abort")  # pruned: its blocks go back to the pool
                continue
            # Forks copy the parent's tokens before the parent takes its own continuation.
            for cont in conts[1:]:
                child = self._new_seq(st, st.next_index, list(parent.token_ids), parent.arrival_time)
                st.next_index += 1
                st.seqs.append(child)
                if parent.status is SeqStatus.RUNNING:
                    self.scheduler.add_forked(parent, child)
                else:
                    self.scheduler.waiting.appendleft(child)  # parent was preempted: recompute
                child.token_ids.append(cont.token_id)
                child.beam_score = cont.score
            parent.token_ids.append(conts[0].token_id)
            parent.beam_score = conts[0].score

    def _fork(self, parent: Sequence) -> list[Sequence]:
        state = self.requests[parent.request_id]
        children = []
        for _ in range(parent.pending_forks):
            child = self._new_seq(state, len(state.seqs), list(parent.token_ids), parent.arrival_time)
            state.seqs.append(child)
            self.scheduler.add_forked(parent, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _append_token(self, seq: Sequence, res, now: float) -> None:
        st = self.requests[seq.request_id]
        params = seq.params
        seq.token_ids.append(res.token_id)
        if st.metrics.first_token_time is None:
            st.metrics.first_token_time = now
            st.metrics.time_to_first_token = now - st.metrics.arrival_time
        if params.logprobs is not None:
            seq.output_logprobs.append(self._logprob_dict(res, params.logprobs))
        if params.logprobs is not None:
            seq.cumulative_logprob += res.logprob
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= params.min_tokens:
            if not params.ignore_eos and res.token_id in self.eos_token_ids:
                reason = "stop"
            elif res.token_id in params.stop_token_ids:
                reason, stop_reason = "stop", res.token_id
        # A terminating token stays out of the text unless asked for, as in vLLM.
        if seq.detokenizer is not None and (reason is None or params.include_stop_str_in_output):
            seq.text_delta += seq.detokenizer.add(res.token_id)
            if reason is None:
                hit = seq.detokenizer.check_stop()
                if hit is not None:
                    reason, stop_reason = "stop", hit
        if reason is None and n_out >= params.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.layout.max_model_len and not self._length_unbounded:
            reason = "length"
        if reason is not None:
            self._finish_seq(seq, reason, stop_reason)
            self._maybe_finish_request(st)

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason, stop_reason)
        if seq.detokenizer is not None:
            seq.text_delta += seq.detokenizer.flush()

    def _maybe_finish_request(self, st: RequestState) -> None:
        if all(s.is_finished for s in st.seqs) and not st.finished:
            st.finished = True
            st.metrics.finished_time = time.monotonic()

    def _make_output(self, st: RequestState) -> RequestOutput:
        if st.beam is not None:
            return self._make_beam_output(st)
        outs = []
        for seq in st.seqs:
            text = ""
            if seq.detokenizer is not None:
                text = seq.detokenizer.text
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, text_delta=seq.text_delta,
            ))
            seq.text_delta = ""
        m = st.metrics
        m.num_output_tokens = sum(len(o.token_ids) for o in outs)
        m.num_cached_tokens = max((s.num_cached_tokens for s in st.seqs), default=0)
        m.num_preemptions = sum(s.num_preemptions for s in st.seqs)
        owner = st.prompt_logprobs_owner
        return RequestOutput(
            request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
            prompt_logprobs=list(owner.prompt_logprobs) if owner is not None else None,
            outputs=outs, finished=st.finished, metrics=m, num_cached_tokens=m.num_cached_tokens,
        )

    def _make_beam_output(self, st: RequestState) -> RequestOutput:
        if st.finished and st.beam.finished:
            hyps = [(h.token_ids, h.cum_logprob, h.finish_reason, h.score) for h in st.beam.finished]
        else:
            live = sorted((s for s in st.seqs if not s.is_finished), key=lambda s: -s.beam_score)
            hyps = [(s.output_token_ids, s.beam_score, None, s.beam_score) for s in live]
        outs = []
        for i, (ids, cum, reason, score) in enumerate(hyps):
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(ids), cumulative_logprob=cum,
                                         logprobs=None, finish_reason=reason or ("abort" if st.finished else None)))
        m = st.metrics
        m.num_output_tokens = len(outs[0].token_ids) if outs else 0
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             prompt_logprobs=None, outputs=outs, finished=st.finished, metrics=m,
                             extra={"beam_scores": [h[3] for h in hyps]})
