"""EngineCore: the step without a model. The scheduler plans, the KV core keeps the blocks, a
runner executes the plan, and a handler turns what the runner returned into tokens.

`LLMEngine` builds one with the real model runner and itself as the handler (sampling,
detokenizing, stop checks); model-free tests build one with a fake runner that returns token ids
and a handler that appends them, so both run the very same step: plan, log the step's reads and
writes, execute, publish the blocks the step completed, hand over the output, audit.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kvshare.config import EngineConfig
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.step_plan import StepPlan
from kvshare.kvcache.audit import KVAuditor, record_step_io
from kvshare.kvcache.events import EventLog, as_event_log
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.view_tap import ViewTap

Output = TypeVar("Output")
Output_co = TypeVar("Output_co", covariant=True)
Output_contra = TypeVar("Output_contra", contravariant=True)


class StepRunner(Protocol[Output_co]):
    """Runs a step plan: the model (kvshare.engine.model_runner, returning logits) or a fake."""

    def execute(self, plan: StepPlan) -> Output_co: ...


class StepHandler(Protocol[Output_contra]):
    """The caller's side of a step."""

    def planned(self, plan: StepPlan) -> None:
        """A non-empty plan, before the forward pass."""

    def computed(self, plan: StepPlan, output: Output_contra) -> None:
        """After the forward pass, the plan's KV written and its full blocks published: append
        the sampled tokens, fork, finish sequences (through the scheduler)."""


@dataclass
class EngineStats:
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputes count)
    decode_tokens_computed: int = 0
    peak_blocks_in_use: int = 0


@dataclass
class EngineStatus:
    """What a caller may know of the engine between steps (the server's /metrics, Ray's router)."""

    running: int = 0  # requests with a running sequence
    waiting: int = 0  # requests with none running and one waiting
    blocks_in_use: int = 0
    blocks_total: int = 1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    step: int = 0
    # The KV tiers under the pool (kvshare/kvcache/kv_tiers.py; empty without them): blocks kept and
    # budgets in blocks per tier, prompt tokens served from a tier, tier blocks refused as invalid.
    tiers: dict[str, int] = field(default_factory=dict)
    # Requests running / waiting by their priority (as `running` and `waiting`; all 0 under fcfs).
    running_by_priority: dict[int, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)


class EngineCore(Generic[Output]):
    def __init__(self, config: EngineConfig, kv: KVCacheCoordinator, runner: StepRunner[Output],
                 handler: StepHandler[Output]) -> None:
        self.config = config
        self.kv = kv
        self.runner = runner
        self.handler = handler
        self.scheduler = Scheduler(config, kv)
        self.events: EventLog | None = None
        # The live KV view's recorder (kvshare.engine.kv_view), in front of `events` while a view
        # client listens; None otherwise, so nothing is recorded for a view nobody watches.
        self.view_tap: ViewTap | None = None
        self.auditor: KVAuditor | None = None
        self.step_count = 0
        self.stats = EngineStats()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> StepPlan:
        """One step: plan, log its I/O, run it, publish what it computed, hand the output over,
        audit. Returns the plan (empty when nothing could be scheduled)."""
        self.step_count += 1
        events = self.kv.events  # the log, or a recorder that records nothing
        events.step = self.step_count
        events.record("step")
        plan = self.scheduler.schedule()
        if not plan.is_empty():
            self.handler.planned(plan)
            record_step_io(self.kv.events, self.auditor, plan)
            output = self.runner.execute(plan)
            stats = self.stats
            stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.kv.num_used_blocks())
            scheduled = self.scheduler.scheduled_seqs
            for c in plan.chunks:
                in_prompt = max(0, min(c.end, scheduled[c.seq_id].num_prompt_tokens) - c.start)
                stats.prompt_tokens_computed += in_prompt
                stats.decode_tokens_computed += c.num_tokens - in_prompt
            self.scheduler.step_done(plan)
            self.handler.computed(plan, output)
        if self.auditor is not None:
            self.auditor.check_state()
        events.flush()
        return plan

    # ---- state callers may read ------------------------------------------------------------
    def is_idle(self) -> bool:
        """No sequence scheduled or holding blocks."""
        return not self.scheduler.has_work() and not self.kv.tables

    def status(self) -> EngineStatus:
        sched, kv = self.scheduler, self.kv
        running = {s.request_id: s.params.priority for s in sched.running}
        waiting = {s.request_id: s.params.priority for s in sched.waiting if s.request_id not in running}
        return EngineStatus(running=len(running), waiting=len(waiting), blocks_in_use=kv.num_used_blocks(),
                            blocks_total=kv.num_blocks, prefix_cache_queries=kv.stats.queries,
                            prefix_cache_hits=kv.stats.hits, preemptions=sched.num_preemptions,
                            step=self.step_count, tiers=self.tier_status(),
                            running_by_priority=dict(Counter(running.values())),
                            waiting_by_priority=dict(Counter(waiting.values())))

    def tier_status(self) -> dict[str, int]:
        tiers = self.kv.pool.tiers
        if tiers is None:
            return {}
        t = tiers.stats()
        keys = ("ram_blocks", "ram_capacity_blocks", "disk_blocks", "disk_capacity_blocks", "rejected")
        return {**{k: t[k] for k in keys}, "hit_tokens": t["hit_tokens"]}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (held ones stay: their holders need them), and
        the RAM tier's (kvshare/kvcache/kv_tiers.py)."""
        self.kv.reset_prefix_cache()

    def cached_block_hashes(self) -> set[bytes]:
        return set(self.kv.pool.cached)

    def live_tokens(self) -> dict[str, list[int]]:
        return {s.seq_id: s.token_ids for s in self.scheduler.running}

    # ---- the block event log, the audit and the view's recorder ----------------------------
    def set_audit(self, audit: bool, event_log: str | None = None) -> None:
        """Attach (or detach) the event log and the auditor; only while idle, so the audit's
        shadow of written KV starts from a state it can vouch for (nothing cached)."""
        if not self.is_idle():
            raise RuntimeError("set_audit() needs an idle engine")
        if self.events is not None:
            self.events.close()
        self.events = EventLog(path=event_log) if (audit or event_log) else None
        self.auditor = None
        if self.events is not None:
            self.kv.reset_prefix_cache()
            self.events.record("pool", num_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
                               prefix_caching=self.config.enable_prefix_caching)
            if audit:
                self.auditor = KVAuditor(self.kv, self.events, self.live_tokens)
        self._install_event_log()

    def set_view_tap(self, tap: ViewTap | None) -> None:
        """Put the live view's recorder in front of the event log (None: take it away). Any time
        between steps: unlike the audit, the view vouches for nothing, it only reports."""
        self.view_tap = tap
        self._install_event_log()

    def _install_event_log(self) -> None:
        log: Any = self.events
        if self.view_tap is not None:
            self.view_tap.inner = as_event_log(self.events)
            log = self.view_tap
        self.kv.events = self.kv.pool.events = log
