"""LLMEngine: add_request / abort_request / step, the loop the offline API, the server and
the doctor all drive. Request intake (kvshare.engine.intake), the output side of a step
(kvshare.engine.output_processor) and beam search (kvshare.engine.beam_search) are its parts;
this module wires them to the scheduler, the model runner and the KV cache manager."""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from kvshare.config import EngineConfig
from kvshare.engine.beam_search import BeamSearchDriver, BeamSearchParams
from kvshare.engine.detokenizer import IncrementalDetokenizer
from kvshare.engine.intake import MULTIMODAL_PROMPT_KEYS, PROMPT_DICT_KEYS, RequestIntake  # noqa: F401 (re-exported)
from kvshare.engine.model_runner import StepLogits
from kvshare.engine.model_setup import build_rank, plan_kv
from kvshare.engine.output_processor import OutputProcessor
from kvshare.engine.request import RequestState, Sequence
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.startup import KVLayout, StartupReport, release_freed_heap
from kvshare.engine.structured_output import StructuredOutputs
from kvshare.engine.tensor_parallel import TensorParallelLauncher, TensorParallelRunner, threads_per_rank
from kvshare.errors import InvalidRequestError
from kvshare.kvcache.audit import KVAuditor, record_step_io
from kvshare.kvcache.events import EventLog, as_event_log
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import grouped_blocks_per_seq
from kvshare.kvcache.prefix_updates import PrefixUpdateQueue
from kvshare.kvcache.view_tap import ViewTap
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model import kernels
from kvshare.model.loader import load_model
from kvshare.model.numerics import numerics_for
from kvshare.model.sampler import Sampler, SamplingRow, apply_token_bitmask
from kvshare.model.tensor_parallel import TPShard
from kvshare.outputs import RequestMetrics, RequestOutput
from kvshare.sampling_params import SamplingParams

logger = logging.getLogger("kvshare")


@dataclass
class EngineStats:
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputes count)
    decode_tokens_computed: int = 0
    peak_blocks_in_use: int = 0


class LLMEngine:
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
        # Sized by the same code as `kvshare memory` plans with (scale bytes included when quantized).
        self.kv_format = config.kv_format
        kv = plan_kv(config, mc)
        self.kv_groups, self.kv_policy = kv.groups, kv.policy
        bytes_per_token = self.kv_format.bytes_per_token(kv.layers_per_block, mc.num_kv_heads, mc.head_dim)
        num_blocks = kv_pool_blocks(config.kv_budget_bytes(), bytes_per_token, config.block_size)
        max_model_len = kv.max_model_len
        # Sink sequences keep cache positions below max_model_len whatever their length.
        length_unbounded = self.kv_policy.generates_past_max_model_len
        hasher = BlockHasher.seeded(config.block_size, config.prefix_caching_hash_seed)
        self.layout = KVLayout(bytes_per_token, config.block_size, num_blocks, max_model_len, self.kv_format.name,
                               len(self.kv_groups), self._seq_blocks(max_model_len) or 0)
        self.manager = KVCacheCoordinator(num_blocks, config.block_size, self.kv_groups,
                                          config.enable_prefix_caching, hasher=hasher)
        # With tensor parallelism this rank holds its shard; the pool's bytes (the layout) are all ranks'.
        tp = launcher.connect(TPShard(0, launcher.size, mc), num_blocks) if launcher is not None else None
        self.model, self.kv_cache, self.runner = build_rank(config, mc, loaded.weights, kv, num_blocks, self.numerics,
                                                            tp)
        if tp is not None:
            self.runner = TensorParallelRunner(self.runner, launcher, tp)
        release_freed_heap()  # the load's temporaries: back to the OS, not kept as RSS
        self.startup = StartupReport(loaded.source, loaded.tensor_types, self.model, config,
                                     self.layout, loaded.load_seconds, time.perf_counter() - t_start,
                                     launcher.transport_name if launcher is not None else "", self.numerics)
        del loaded
        for line in self.startup.lines():
            logger.info(line)
        self.scheduler = Scheduler(config, self.manager)
        self.events: EventLog | None = None
        # The live KV view's recorder (kvshare.engine.kv_view), in front of `events` while a view
        # client listens; None otherwise, so nothing is recorded for a view nobody watches.
        self.view_tap: ViewTap | None = None
        self.auditor: KVAuditor | None = None
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = list(mc.eos_token_ids)
        # Grammars for constrained decoding; llguidance's tokenizer is built on the first one.
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.intake = RequestIntake(self.tokenizer, mc.vocab_size, self.layout, self.kv_policy,
                                    config.max_num_batched_tokens, length_unbounded, self._seq_blocks,
                                    config.sink_max_tokens)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.eos_token_ids, max_model_len,
                                       length_unbounded)
        self.beams = BeamSearchDriver(self.scheduler, self._new_seq, self.outputs.finish_seq,
                                      self.outputs.maybe_finish_request, self._constrain_beam)
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self.step_count = 0
        self.stats = EngineStats()
        self.set_audit(config.audit, config.kv_event_log)
        self.prefix_update_publisher = None
        if config.kv_events_endpoint:
            from kvshare.engine.prefix_update_publisher import ZmqPrefixUpdatePublisher  # pyzmq only when asked for

            self.manager.pool.prefix_updates = PrefixUpdateQueue(config.block_size, "CPU")
            self.prefix_update_publisher = ZmqPrefixUpdatePublisher(
                config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic,
                data_parallel_rank=config.data_parallel_rank, include_token_ids=config.kv_events_token_ids)
            logger.info("KV events: publishing on %s%s", self.prefix_update_publisher.endpoint,
                        f", replay on {self.prefix_update_publisher.replay_endpoint}"
                        if self.prefix_update_publisher.replay_endpoint else "")

    def close(self) -> None:
        """Release what outlives a step: the KV event sockets, the event log file and the
        tensor-parallel workers."""
        close_runner = getattr(self.runner, "close", None)
        if close_runner is not None:
            close_runner()
        if self.prefix_update_publisher is not None:
            self.publish_prefix_updates()
            self.prefix_update_publisher.close()
            self.prefix_update_publisher = None
        self.manager.events.close()

    def publish_prefix_updates(self) -> None:
        if self.prefix_update_publisher is not None:
            self.prefix_update_publisher.publish(self.manager.pool.prefix_updates.drain())

    def _seq_blocks(self, num_tokens: int) -> int | None:
        """Most blocks one sequence of `num_tokens` holds across several KV cache groups (None: one
        group, the intake's own slot count applies)."""
        return grouped_blocks_per_seq(self.kv_groups, self.config.block_size, num_tokens,
                                      self.config.max_num_batched_tokens)

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
        self._install_event_log()

    def set_view_tap(self, tap: ViewTap | None) -> None:
        """Put the live view's recorder in front of the event log (None: take it away). Any time
        between steps: unlike the audit, the view vouches for nothing, it only reports."""
        self.view_tap = tap
        self._install_event_log()

    def _install_event_log(self) -> None:
        log = self.events
        if self.view_tap is not None:
            self.view_tap.inner = as_event_log(self.events)
            log = self.view_tap
        self.manager.events = self.manager.pool.events = log

    # ---- submission ----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.intake.tokenize(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        beam_params = None
        if isinstance(params, BeamSearchParams):
            # Beams stop themselves (EOS, length); the sequences underneath just decode.
            beam_params = params
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                    structured_outputs=params.structured_outputs)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        text, token_ids, params = self.intake.prepare(prompt, params)
        # Compiled (or found in the cache: the server compiles off this thread) before anything is queued.
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        now = arrival_time if arrival_time is not None else time.monotonic()
        metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids))
        state = RequestState(request_id, text, token_ids, params, [], metrics)
        if beam_params is not None:
            self.beams.start(request_id, beam_params, self.eos_token_ids)
        # n > 1: one sequence computes the prompt; the others fork off it when it samples.
        first = self._new_seq(state, 0, list(token_ids), now)
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

    def _new_seq(self, state: RequestState, index: int, token_ids: list[int], now: float) -> Sequence:
        params = state.params
        several = params.n > 1 or self.beams.drives(state.request_id)  # then each seq id names its index
        seq = Sequence(
            seq_id=f"{state.request_id}#{index}" if several else state.request_id,
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

    # ---- lifecycle -----------------------------------------------------------------------
    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self.requests.get(rid)
            if state is None or state.finished:
                continue  # unknown or already done: aborting twice is a no-op
            for seq in state.seqs:
                if not seq.is_finished:
                    self.manager.events.record("abort", seq=seq.seq_id)
                self.outputs.finish_seq(seq, "abort")
            self.outputs.maybe_finish_request(state)
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
        events = self.manager.events  # the log, or a recorder that records nothing
        events.step = self.step_count
        events.record("step")
        sched = self.scheduler.schedule()
        if not sched.is_empty():
            now = time.monotonic()
            scheduled = self.scheduler.scheduled_seqs
            for c in sched.chunks:
                st = self.requests[scheduled[c.seq_id].request_id]
                if st.metrics.first_scheduled_time is None:
                    st.metrics.first_scheduled_time = now
            record_step_io(self.manager.events, self.auditor, sched)
            logits = self.runner.execute(sched)
            stats = self.stats
            stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.manager.num_used_blocks())
            for c in sched.chunks:
                seq = scheduled[c.seq_id]
                in_prompt = max(0, min(c.end, seq.num_prompt_tokens) - c.start)
                stats.prompt_tokens_computed += in_prompt
                stats.decode_tokens_computed += c.num_tokens - in_prompt
                touched[seq.request_id] = self.requests[seq.request_id]
            self.scheduler.step_done(sched)
            self.outputs.record_prompt_logprobs(logits)
            self._sample(logits)
        if self.auditor is not None:
            self.auditor.check_state()
        events.flush()
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

    def _sample(self, step: StepLogits) -> None:
        if not step.sample_chunks:
            return
        seqs: list[Sequence] = []
        row_of: list[int] = []
        beam_requests: dict[str, RequestState] = {}
        sampling = [self.scheduler.scheduled_seqs[c.seq_id] for c in step.sample_chunks]
        for r, seq in enumerate(sampling):
            if self.beams.drives(seq.request_id):
                self.beams.take_logits(seq, step.sample_logits[r])
                beam_requests[seq.request_id] = self.requests[seq.request_id]
                continue
            seqs.append(seq)
            row_of.append(r)
            if seq.pending_forks:
                # The prompt is computed once; each fork draws its own first token from it.
                for child in self._fork(seq):
                    seqs.append(child)
                    row_of.append(r)
        now = time.monotonic()
        # Time to first token, recorded here only: the first step that samples for a request. For
        # beam search that is also the step its beams first advance (it starts with a single beam,
        # so there is no sibling to wait for).
        for seq in sampling:
            m = self.requests[seq.request_id].metrics
            if m.first_token_time is None:
                m.first_token_time = now
                m.time_to_first_token = now - m.arrival_time
        if seqs:
            logits = step.sample_logits
            if row_of != list(range(logits.shape[0])):
                logits = logits[torch.tensor(row_of)]
            rows = [
                SamplingRow(s.params, s.generator, s.token_ids[:s.num_prompt_tokens], s.output_token_ids,
                            self.eos_token_ids)
                for s in seqs
            ]
            for seq, res in zip(seqs, self.sampler(logits, rows, self._token_bitmask(seqs))):
                self._append_token(seq, res, now)
        for st in beam_requests.values():
            self.beams.step(st)

    def _token_bitmask(self, seqs: list[Sequence]):
        """The allowed tokens of this step's constrained rows (None when no row has a grammar)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        for i in rows:
            seqs[i].grammar.sync(seqs[i].output_token_ids)
        return self.structured.fill_bitmask([seqs[i].grammar for i in rows], rows)

    def _constrain_beam(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        if seq.grammar is None:
            return logits
        seq.grammar.sync(seq.output_token_ids)
        return apply_token_bitmask(logits.unsqueeze(0), self.structured.fill_bitmask([seq.grammar], [0]))[0]

    def _fork(self, parent: Sequence) -> list[Sequence]:
        state = self.requests[parent.request_id]
        children = []
        for _ in range(parent.pending_forks):
            child = self._new_seq(state, len(state.seqs), list(parent.token_ids), parent.arrival_time)
            if parent.grammar is not None:
                child.grammar = parent.grammar.copy()  # its own matcher, never the parent's
            state.seqs.append(child)
            self.scheduler.add_forked(parent, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _append_token(self, seq: Sequence, res, now: float) -> None:
        # An engine method, not a direct call into the output processor, so that a fault
        # (kvshare.testing.faults) can wrap it. `now` is the step's sampling time.
        self.outputs.append_token(self.requests[seq.request_id], seq, res)
