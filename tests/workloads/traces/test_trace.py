from __future__ import annotations

import pytest

from workloads.traces.generators import WORKLOADS, generate
from workloads.traces.trace import Session, Trace, Turn, read_trace, write_trace


def _hand_made() -> Trace:
    return Trace(
        workload="hand",
        seed=3,
        params={"users": 1, "note": "x"},
        documents={"d1": "A shared document.", "d2": "Another one."},
        sessions=(
            Session("s0", (Turn("hello", 8), Turn("more", 4, think_s=0.5)), system="sys",
                    documents=("d1", "d2"), arrival_s=1.25),
            Session("s1", (Turn("q", 2, branches=("a", "b"), ignore_eos=True),),
                    template="raw"),
        ),
    )


def test_hand_made_trace_survives_a_jsonl_round_trip(tmp_path):
    trace = _hand_made()
    path = tmp_path / "sub" / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    assert trace.num_requests == 2 + 3
    assert len(path.read_text().splitlines()) == 1 + 2 + 2


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_generated_trace_survives_a_jsonl_round_trip(workload, tokenizer, source, tmp_path):
    trace = generate(workload, tokenizer, seed=1, source=source)
    write_trace(trace, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == trace


def test_reading_a_file_without_header_raises(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"kind": "document", "id": "d", "text": "x"}\n')
    with pytest.raises(ValueError, match="header"):
        read_trace(path)


def test_reading_a_malformed_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"kind": "header", "workload": "w", "seed": 0}\n{"kind": "nope"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_trace(path)


def test_session_referencing_a_missing_document_raises():
    with pytest.raises(ValueError, match="document"):
        Trace("w", 0, {}, {}, (Session("s", (Turn("x", 1),), documents=("gone",)),))


def test_turn_with_no_tokens_to_generate_raises():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Trace("w", 0, {}, {}, (Session("s", (Turn("x", 0),)),))
