"""End of stream: a close record ends it after a step; producers stop there, readers end there."""

from __future__ import annotations

import pytest

from lakestream import StreamClosed
from lakestream import _decisions as decisions
from lakestream._layout import segment_key
from lakestream._records import CommitRecord, RegisterRecord, TgbRef, encode_record
from lakestream._state import Config, State


def pending(seqs: range) -> list[decisions.PendingTgb]:
    return [decisions.PendingTgb(i, TgbRef(segment_key("p", 1, i, 0.0), ((0, 1, 0, 1),), i + 1)) for i in seqs]


def stream(steps: int) -> State:
    """A stream of one producer `p` (epoch 1) that committed `steps` steps of one sample."""
    state = State()
    state.apply(0, encode_record(decisions.create(Config(world_size=1, global_batch=1), 0.0)))
    state.apply(1, encode_record(RegisterRecord("p", 1, "t", 0.0)))
    if steps:
        state.apply(2, encode_record(CommitRecord("p", 1, 0, tuple(t.ref for t in pending(range(steps))), 0, 0.0)))
    return state


def append(state: State, record: object) -> None:
    assert record is not None
    assert state.apply(state.version + 1, encode_record(record)) is None  # type: ignore[arg-type]


def test_close_and_reopen_decisions() -> None:
    state = stream(3)
    with pytest.raises(ValueError, match="steps up to 2 are committed"):
        decisions.close(state, 1, 0.0)
    append(state, decisions.close(state, None, 0.0))  # at the head
    assert state.closed_after == 2 and state.ended
    assert decisions.close(state, None, 0.0) is None and decisions.close(state, 2, 0.0) is None  # closed there
    with pytest.raises(ValueError, match="closed already after step 2; reopen"):
        decisions.close(state, 5, 0.0)
    append(state, decisions.reopen(state, 0.0))
    assert state.closed_after is None and decisions.reopen(state, 0.0) is None
    assert decisions.close(stream(0), -1, 0.0) is not None  # an empty stream, closed before step 0
    append(state, decisions.close(state, 4, 0.0))
    assert state.closed_after == 4 and not state.ended


def test_a_producer_commits_up_to_the_close_and_then_is_told() -> None:
    state = stream(3)
    append(state, decisions.close(state, 4, 0.0))
    record = decisions.commit(state, "p", 1, pending(range(3, 8)), 0, 0.0)
    assert record is not None and [record.seq, len(record.tgbs)] == [3, 2]  # steps 3 and 4, not past the close
    append(state, record)
    assert state.head == 4 and state.ended
    with pytest.raises(StreamClosed, match="closed after step 4: producer 'p' stops"):
        decisions.commit(state, "p", 1, pending(range(5, 8)), 0, 0.0)
    assert decisions.commit(state, "p", 1, pending(range(3, 5)), 0, 0.0) is None  # all landed: nothing to say


def test_combining_leaves_out_what_is_past_the_close() -> None:
    state = stream(3)
    append(state, decisions.close(state, 4, 0.0))
    intents = [CommitRecord("p", 1, 3, tuple(t.ref for t in pending(range(3, 8))), 0, 0.0)]
    group = decisions.combine(state, intents, now=0.0)
    assert group is not None and state.check(group) is None
    append(state, group)
    assert state.head == 4 and decisions.combine(state, intents, now=0.0) is None
