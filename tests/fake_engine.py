"""A model-free engine: kvshare.engine.core.EngineCore with a runner that runs no model and a
handler that appends the runner's token ids. The step is the engine's own (plan, log the step's
I/O, run, publish, hand over, audit); only the forward pass and the sampler are fake."""
from __future__ import annotations

from typing import Callable

from kvshare.config import EngineConfig
from kvshare.engine.core import EngineCore
from kvshare.engine.request import Sequence
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.step_plan import StepPlan


def fake_token(seq: Sequence) -> int:
    # Deterministic and never inside a prompt range the tests use (prompts use bases < 1000).
    return 1000 + len(seq.token_ids)


class FakeRunner:
    """Executes a plan without a model: each sampling chunk's next token is next_token(seq) (the
    plan carries sequence ids; the scheduler, set once the core is built, has their sequences)."""

    def __init__(self, next_token: Callable[[Sequence], int] = fake_token) -> None:
        self.next_token = next_token
        self.scheduler: Scheduler | None = None
        self.plans: list[StepPlan] = []  # every non-empty plan it was given, in order

    def execute(self, plan: StepPlan) -> dict[str, int]:
        self.plans.append(plan)
        seqs = self.scheduler.scheduled_seqs
        return {c.seq_id: self.next_token(seqs[c.seq_id]) for c in plan.chunks if c.samples}


class AppendTokens:
    """The handler: append each sampled token; a sequence reaching its max_tokens finishes."""

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.finished: list[Sequence] = []  # in the order they finished
        # A test's look inside one step, between planning and the forward pass: what planning did
        # (tables, evictions, copies) before the step's writes publish or release anything.
        self.on_planned: Callable[[StepPlan], None] | None = None

    def planned(self, plan: StepPlan) -> None:
        if self.on_planned is not None:
            self.on_planned(plan)

    def computed(self, plan: StepPlan, output: dict[str, int]) -> None:
        for c in plan.chunks:
            if c.samples:
                seq = self.scheduler.scheduled_seqs[c.seq_id]
                seq.token_ids.append(output[c.seq_id])
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.finish(seq, "length")
                    self.finished.append(seq)


def model_free_core(config: EngineConfig, kv, next_token: Callable[[Sequence], int] = fake_token) -> EngineCore:
    handler = AppendTokens()
    runner = FakeRunner(next_token)
    core = EngineCore(config, kv, runner, handler)
    handler.scheduler = runner.scheduler = core.scheduler
    return core


def run_step(core: EngineCore, during: Callable[[StepPlan], None] | None = None) -> StepPlan:
    """One engine step; its plan. `during(plan)`, when given, runs inside the step once the plan
    is made and before it runs (not at all for an empty plan)."""
    core.handler.on_planned = during
    try:
        plan = core.step()
    finally:
        core.handler.on_planned = None
    if during is not None and plan.is_empty():
        raise AssertionError("the step planned nothing: `during` never ran")
    return plan


def step(core: EngineCore) -> list[Sequence]:
    """One engine step; the sequences it finished."""
    before = len(core.handler.finished)
    run_step(core)
    return core.handler.finished[before:]
