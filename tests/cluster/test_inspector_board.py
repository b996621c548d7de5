"""The board between replicas and the front: replicas are asked for snapshots only while
someone reads, at the budget last asked for, and a silent replica's snapshot goes."""

from __future__ import annotations

from cluster.inspector_board import SILENT_S, WATCH_S, InspectorBoard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_snapshots_are_wanted_only_while_someone_reads() -> None:
    clock = Clock()
    board = InspectorBoard(clock)
    assert board.wanted() is None
    assert board.read(250) == {}
    assert board.wanted() == 250
    clock.now += WATCH_S + 1
    assert board.wanted() is None


def test_the_front_reads_each_replicas_latest_and_silent_ones_are_dropped() -> None:
    clock = Clock()
    board = InspectorBoard(clock)
    board.post("a", "a1")
    board.post("b", "b1")
    board.post("a", "a2")
    assert board.read(10) == {"a": "a2", "b": "b1"}
    clock.now += SILENT_S / 2
    board.post("a", "a3")
    clock.now += SILENT_S / 2 + 1
    assert board.read(10) == {"a": "a3"}
    board.forget("a")
    assert board.read(10) == {}
