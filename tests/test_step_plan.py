"""The step plan is plain data (kvshare/engine/step_plan.py), and its tensor-parallel wire form
is derived from its fields (kvshare/engine/wire.py). Model-free."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack
import pytest

from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan
from kvshare.engine.tensor_parallel import _decode, _encode
from kvshare.engine.wire import codec


def over_the_wire(encode, decode, value):
    return decode(msgpack.unpackb(msgpack.packb(encode(value))))


def full_plan() -> StepPlan:
    """Every field set, none at its default."""
    return StepPlan(
        chunks=[ChunkPlan("req-1#0", 40, [7], 36, (GroupAccess([645], [3, 9], [0, 2]), GroupAccess([81], [5], None)),
                          True, None),
                ChunkPlan("req-2", 0, [1, 2, 3], 0, (GroupAccess([16, 17, 18], [1], None), GroupAccess([16, 17, 18], [1], [0]),
                                                    GroupAccess([33, 34, 35], [2], None)), False, (0, 2))],
        preempted=["req-3", "req-4#1"], block_copies=[(4, 11), (5, 12)], rotations=[("req-1#0", [3, 9], -16)],
        block_loads=[(20, b"\x00\xffhash-a"), (21, b"hash-b")], block_stores=[(3, b"hash-c")],
        tier_drops=[("cpu", b"hash-d", 0), ("disk", b"hash-e", 5)])


def test_a_plan_round_trips_through_the_wire_equal_to_itself():
    plan = full_plan()
    assert all(getattr(plan, f.name) != f.default_factory() for f in dataclasses.fields(StepPlan))
    got = over_the_wire(_encode, _decode, plan)
    assert got == plan
    assert got.block_loads == [(20, b"\x00\xffhash-a"), (21, b"hash-b")] and got.block_stores == [(3, b"hash-c")]
    assert got.tier_drops == [("cpu", b"hash-d", 0), ("disk", b"hash-e", 5)]
    assert got.chunks[1].prompt_logits == (0, 2) and got.chunks[1].kv[2].read_index is None
    assert got.logit_rows() == plan.logit_rows()
    assert over_the_wire(_encode, _decode, StepPlan()) == StepPlan()  # block_loads / stores default empty
    assert StepPlan().block_loads == [] and StepPlan().block_stores == [] and StepPlan().tier_drops == []


def test_the_plan_holds_ids_not_records():
    # Everything in a plan is a number, a string, bytes, a bool, None or a container of them.
    def plain(v) -> bool:
        if dataclasses.is_dataclass(v):
            return all(plain(getattr(v, f.name)) for f in dataclasses.fields(v))
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (int, float, str, bytes, bool))

    assert plain(full_plan())
    assert [f.name for f in dataclasses.fields(ChunkPlan)][0] == "seq_id"


@dataclass
class TaggedChunk(ChunkPlan):
    tags: list[str] = field(default_factory=list)


@dataclass
class PlanWithMore(StepPlan):
    """A field the encoder has never heard of, of a nested dataclass type."""

    tagged: list[TaggedChunk] = field(default_factory=list)
    budget: int | None = None
    pairs: tuple[tuple[int, str], ...] = ()


def test_a_field_added_to_the_plan_travels_with_no_edit_to_the_encoder():
    base = full_plan()
    plan = PlanWithMore(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StepPlan)},
                        tagged=[TaggedChunk("req-9", 8, [5, 6], 8, (GroupAccess([40, 41], [2, 3], None),), True, None, ["x", "y"])],
                        budget=64, pairs=((1, "a"), (2, "b")))
    encode, decode = codec(PlanWithMore)
    got = over_the_wire(encode, decode, plan)
    assert got == plan and type(got) is PlanWithMore and type(got.tagged[0]) is TaggedChunk
    assert got.pairs == ((1, "a"), (2, "b")) and got.tagged[0].kv == (GroupAccess([40, 41], [2, 3], None),)
    # The plan's own codec is the same generic one: its fields, in order, and nothing written per field.
    assert len(_encode(base)) == len(dataclasses.fields(StepPlan))
    assert over_the_wire(*codec(StepPlan), base) == base


def test_a_field_with_no_plain_form_is_refused_when_the_codec_is_built():
    @dataclass
    class Holding:
        seq: object

    with pytest.raises(TypeError, match="no plain wire form"):
        codec(Holding)
    encode, decode = codec(StepPlan)
    with pytest.raises(ValueError, match="fields on the wire"):  # a worker of another version
        decode(encode(StepPlan())[:-1])
