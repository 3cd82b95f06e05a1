"""LLMEngine: add_request / abort_request / step, the loop the offline API, the server and
the doctor all drive. The step itself (scheduler, KV core, runner) is kvshare.engine.core's
EngineCore, with this engine as its handler; request intake (kvshare.engine.intake), the output
side of a step (kvshare.engine.output_processor) and beam search (kvshare.engine.beam_search) are
its other parts. Callers (the server, Ray, the doctor) use the methods under "the engine API"
and read none of its parts."""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from kvshare.config import EngineConfig
from kvshare.engine.beam_search import BeamSearchDriver, BeamSearchParams
from kvshare.engine.core import EngineCore, EngineStatus
from kvshare.engine.engine_api import ENGINE_API
from kvshare.engine.intake import MULTIMODAL_PROMPT_KEYS, PROMPT_DICT_KEYS, RequestIntake  # noqa: F401 (re-exported)
from kvshare.engine.kv_view import kv_snapshot
from kvshare.engine.lora_registry import LORA_ENGINE_METHODS, LoRARegistry, LoRARequest
from kvshare.engine.model_runner import ModelRunner, StepLogits
from kvshare.engine.model_setup import (build_kv_core, build_kv_tiers, build_rank, check_tensor_parallel,
                                        persist_kv_tiers, plan_kv, transparency_gaps)
from kvshare.engine.output_processor import OutputProcessor
from kvshare.engine.request import RequestState, Sequence
from kvshare.engine.sampling_step import StepSampler
from kvshare.engine.startup import StartupReport, release_freed_heap
from kvshare.engine.step_plan import StepPlan
from kvshare.engine.structured_output import StructuredOutputs
from kvshare.engine.tensor_parallel import TensorParallelLauncher, TensorParallelRunner, threads_per_rank
from kvshare.errors import InvalidRequestError
from kvshare.kvcache.kv_groups import grouped_blocks_per_seq
from kvshare.kvcache.view_tap import ViewTap
from kvshare.model import kernels
from kvshare.model.loader import load_model
from kvshare.model.numerics import numerics_for
from kvshare.model.tensor_parallel import TPShard
from kvshare.outputs import RequestMetrics, RequestOutput
from kvshare.sampling_params import SamplingParams

logger = logging.getLogger("kvshare")


class LLMEngine:
    API = ENGINE_API  # what callers may use (kvshare.engine.engine_api)
    add_lora, remove_lora, list_loras = LORA_ENGINE_METHODS  # vLLM's names (kvshare.engine.lora_registry)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Tensor parallel: the worker ranks start first and load their weights while this one does.
        launcher = TensorParallelLauncher(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, launcher)
        except BaseException:
            if launcher is not None:
                launcher.close(None)
            raise

    def _build(self, config: EngineConfig, launcher: TensorParallelLauncher | None) -> None:
        if launcher is not None:
            torch.set_num_threads(threads_per_rank(config))
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        t_start = time.perf_counter()
        kernels.start_background_builds()  # a missing kernel build overlaps the load, never blocks it
        dtype = config.torch_dtype
        loaded = load_model(config.model, dtype=dtype, quantization=config.quantization)
        config.settle_for_weights(loaded.kept_quantized)
        # Every kernel the mode needs is loaded now, before the first step, or the start is refused
        # naming it: which kernel a row takes never changes while the engine runs.
        self.numerics = numerics_for(config.exact, loaded.kept_quantized)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        mc = self.model_config
        self.kv_format = config.kv_format
        kv = plan_kv(config, mc)
        self.kv_groups, self.kv_policy = kv.groups, kv.policy
        self.layout, self.manager = build_kv_core(config, mc, kv)
        num_blocks, max_model_len = self.layout.num_blocks, kv.max_model_len
        # Sink sequences keep cache positions below max_model_len whatever their length.
        length_unbounded = self.kv_policy.generates_past_max_model_len
        # With tensor parallelism this rank holds its shard; the pool's bytes (the layout) are all ranks'.
        if launcher is not None:
            check_tensor_parallel(mc, launcher.size)
        tp = launcher.connect(TPShard(0, launcher.size, mc), num_blocks) if launcher is not None else None
        t_build = time.perf_counter()
        self.model, self.kv_cache, rank_runner = build_rank(config, mc, loaded.weights, kv, num_blocks, self.numerics,
                                                            tp)
        build_seconds = time.perf_counter() - t_build
        self.runner: ModelRunner | TensorParallelRunner = rank_runner
        self.kv_tiers = build_kv_tiers(config, self.manager, self.kv_cache, rank_runner, loaded.source, self.tokenizer)
        # Why sharing may show in a request's bits (empty: it cannot; kvshare doctor then demands equality).
        self.transparency = transparency_gaps(self.numerics, rank_runner, kv, launcher is not None)
        if launcher is not None and tp is not None:
            self.runner = TensorParallelRunner(rank_runner, launcher, tp)
        release_freed_heap()  # the load's temporaries: back to the OS, not kept as RSS
        self.startup = StartupReport(loaded.source, loaded.tensor_types, self.model, config,
                                     self.layout, loaded.load_seconds, time.perf_counter() - t_start,
                                     launcher.transport_name if launcher is not None else "", self.numerics,
                                     self.transparency, build_seconds, torch.get_num_threads())
        del loaded
        for line in self.startup.lines():
            logger.info(line)
        self.core = EngineCore(config, self.manager, self.runner, self)
        self.loras = LoRARegistry(config, mc, rank_runner, self.manager, tensor_parallel=launcher is not None)
        self.scheduler = self.core.scheduler
        self.stats = self.core.stats
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = list(mc.eos_token_ids)
        # Grammars for constrained decoding; llguidance's tokenizer is built on the first one.
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little")
        # Late-bound appends: a fault (kvshare.testing.faults) wraps the engine's _append_token.
        self.sampling = StepSampler(self.tokenizer, self.scheduler, self.structured, self.requests,
                                    self.eos_token_ids, seed, lambda seq, res, now: self._append_token(seq, res, now))
        def seq_blocks(n: int) -> int | None:  # most blocks n tokens hold over the groups (None: one group)
            return grouped_blocks_per_seq(kv.groups, config.block_size, n, config.max_num_batched_tokens)
        self.intake = RequestIntake(self.tokenizer, mc.vocab_size, self.layout, self.kv_policy,
                                    config.max_num_batched_tokens, length_unbounded, seq_blocks, config.sink_max_tokens,
                                    config.scheduling_policy)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.eos_token_ids, max_model_len,
                                       length_unbounded)
        self.beams = BeamSearchDriver(self.scheduler, self.sampling.new_seq, self.outputs.finish_seq,
                                      self.outputs.maybe_finish_request, self.sampling.constrain_beam)
        self.sampling.beams = self.beams
        self._ids = itertools.count()
        self.clock = time.monotonic  # arrivals and deadlines (tests put a fake clock here)
        self.set_audit(config.audit, config.kv_event_log)
        self.prefix_update_publisher = None
        if config.kv_events_endpoint:
            from kvshare.engine.prefix_update_publisher import start_publisher  # pyzmq only when asked for

            self.prefix_update_publisher = start_publisher(config, self.manager.pool)

    def close(self) -> None:
        """Release what outlives a step: KV event sockets, the event log file, the TP workers."""
        persist_kv_tiers(self.kv_tiers, self.runner)  # what the pool still caches, for the next start
        getattr(self.runner, "close", lambda: None)()
        if self.prefix_update_publisher is not None:
            self.publish_prefix_updates()
            self.prefix_update_publisher.close()
            self.prefix_update_publisher = None
        self.manager.events.close()

    def publish_prefix_updates(self) -> None:
        if self.prefix_update_publisher is not None:
            self.prefix_update_publisher.publish(self.manager.pool.prefix_updates.drain())

    # ---- the engine API: what the server, Ray and the doctor may use ------------------------
    def set_audit(self, audit: bool, event_log: str | None = None) -> None:
        """Attach (or detach) the block event log and the auditor; only while idle."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_audit() needs an idle engine")
        self.core.set_audit(audit, event_log)

    def set_view_tap(self, tap: ViewTap | None) -> None:
        self.core.set_view_tap(tap)

    def take_view_events(self) -> list[dict] | None:  # since the last call (None: no view tap)
        return None if self.core.view_tap is None else self.core.view_tap.take()

    def compile_grammar(self, spec) -> object:  # so that a request using `spec` finds it compiled
        return self.structured.compile(spec)

    # The core's: the block event log (None unless auditing or recording), the auditor, the live
    # view's recorder and the number of steps taken.
    events = property(lambda self: self.core.events)
    auditor = property(lambda self: self.core.auditor)
    view_tap = property(lambda self: self.core.view_tap)
    step_count = property(lambda self: self.core.step_count)
    audit_checks = property(lambda self: None if self.core.auditor is None else self.core.auditor.num_checks)
    kv_events_endpoints = property(lambda self: None if self.prefix_update_publisher is None else (
        self.prefix_update_publisher.endpoint, self.prefix_update_publisher.replay_endpoint))
    sampler = property(lambda self: self.sampling.sampler, lambda self, s: setattr(self.sampling, "sampler", s))

    def status(self) -> EngineStatus:
        """Requests running and waiting, blocks in use, prefix-cache counters, the step number."""
        return self.core.status()

    def kv_snapshot(self, blocks: str = "all") -> dict:
        """The pool block by block and the live requests (kvshare.engine.kv_view)."""
        return kv_snapshot(self, blocks)

    def cached_block_hashes(self) -> set[bytes]:
        return self.core.cached_block_hashes()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def zero_kv_cache(self) -> None:
        """Every KV slot of this process back to zero, as in a new engine; only while idle."""
        if not self.is_idle():
            raise RuntimeError("zero_kv_cache() needs an idle engine")
        self.kv_cache.data.zero_()

    def is_idle(self) -> bool:
        """No request left to report and no block held."""
        return not self.has_unfinished_requests() and self.core.is_idle()

    def has_request(self, request_id: str) -> bool:
        """Known, and its final output not returned yet."""
        return request_id in self.requests

    def unfinished(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` still running or waiting."""
        return [rid for rid in request_ids if rid in self.requests and not self.requests[rid].finished]

    # ---- submission ----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.intake.tokenize(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> str:
        params = params or SamplingParams()
        beam_params = None
        if isinstance(params, BeamSearchParams):
            # Beams stop themselves (EOS, length); the sequences underneath just decode.
            beam_params = params
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True, priority=params.priority,
                                    timeout=params.timeout, structured_outputs=params.structured_outputs)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        text, token_ids, params = self.intake.prepare(prompt, params)
        # Compiled (or found in the cache: the server compiles off this thread) before anything is queued.
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        now = arrival_time if arrival_time is not None else self.clock()
        metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids))
        state = RequestState(request_id, text, token_ids, params, [], metrics, adapter=self.loras.adapter_for(lora_request))
        if beam_params is not None:
            self.beams.start(request_id, beam_params, self.eos_token_ids)
        # n > 1: one sequence computes the prompt; the others fork off it when it samples.
        first = self.sampling.new_seq(state, 0, list(token_ids), now)
        first.pending_forks = params.n - 1
        if grammar is not None:
            first.grammar = grammar.new_matcher()
        state.seqs.append(first)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs_owner = state.seqs[0]
            state.seqs[0].prompt_logprobs = [None]
        self.requests[request_id] = state
        self.scheduler.add(first)
        return request_id

    # ---- lifecycle -----------------------------------------------------------------------
    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(rid)
            if state is not None and not state.finished:  # unknown or already done: a no-op
                self.outputs.end_request(state, "abort")
                if self.auditor is not None:
                    self.auditor.check_state()

    def has_unfinished_requests(self) -> bool:
        return any(not s.reported_final for s in self.requests.values())

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for s in self.requests.values() if not s.finished)

    def step(self) -> list[RequestOutput]:
        now = self.clock()  # deadlines, between steps: a request past its own ends before this step plans
        for st in [r for r in self.requests.values() if not r.finished and r.deadline is not None and r.deadline <= now]:
            self.outputs.end_request(st, "timeout")
        plan = self.core.step()
        scheduled = self.scheduler.scheduled_seqs
        touched = {rid: self.requests[rid] for rid in (scheduled[c.seq_id].request_id for c in plan.chunks)}
        self.publish_prefix_updates()
        # Requests finished outside a step (aborts) still owe their final output.
        for st in self.requests.values():
            if st.finished and not st.reported_final:
                touched[st.request_id] = st
        outputs = [self.outputs.make_output(st, self.beams.get(st.request_id)) for st in touched.values()]
        for st in touched.values():
            if st.finished:
                st.reported_final = True
                del self.requests[st.request_id]
                self.beams.forget(st.request_id)
        return outputs

    # ---- EngineCore's handler -------------------------------------------------------------
    def planned(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for c in plan.chunks:
            st = self.requests[self.scheduler.scheduled_seqs[c.seq_id].request_id]
            if st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now

    def computed(self, plan: StepPlan, logits: StepLogits) -> None:
        self.outputs.record_prompt_logprobs(logits)
        self.sampling.sample(logits)

    def _append_token(self, seq: Sequence, res, now: float) -> None:
        # An engine method, not a direct call into the output processor, so that a fault
        # (kvshare.testing.faults) can wrap it. `now` is the step's sampling time.
        self.outputs.append_token(self.requests[seq.request_id], seq, res)
