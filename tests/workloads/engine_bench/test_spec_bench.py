"""The speculation bench end to end on a small run: both engines give the same greedy tokens
(the bench asserts it) on a repeating trace and on the constrained one, and regenerations get
drafts accepted."""

from __future__ import annotations

import json

import jsonschema

from workloads.engine_bench import speculation as spec_bench


def test_the_bench_runs_constrained_and_repeating_traces_with_identical_answers(tmp_path) -> None:
    out = tmp_path / "spec.json"
    runs = spec_bench.main(["--trace", "json_extract", "--trace", "choices", "--concurrency", "1",
                            "--requests", "4", "--max-new-tokens", "24", "--repeats", "1",
                            "--dtype", "float32", "--json", str(out)])
    by_trace = {r.trace: r for r in runs}
    assert set(by_trace) == {"json_extract", "choices"}
    assert all(r.identical and r.generated_tokens > 0 for r in runs)
    assert by_trace["choices"].accepted_tokens > 0  # regenerations draft from the tree
    assert json.loads(out.read_text())[0]["trace"] == runs[0].trace


def test_the_extract_trace_asks_for_what_its_schema_allows() -> None:
    traces = spec_bench.build_traces(2)
    assert len(traces["json_extract"]) == 2
    assert "first sentence" in traces["json_extract"][0][-1]["content"]
    jsonschema.Draft202012Validator.check_schema(spec_bench.SCHEMAS["json_extract"])


def test_the_draft_ceiling_counts_decode_passes_with_free_drafts() -> None:
    fresh = ([1, 2, 3], list(range(10, 18)))  # nothing repeats: one token per pass
    assert spec_bench.draft_ceiling([fresh], k=4) == 1.0
    # The same request again follows the first exactly: passes take 4 drafts + 1, then 1 + 1.
    assert spec_bench.draft_ceiling([fresh, fresh], k=4) == 14 / 9
    # Its own context repeats: no draft until the token 7 recurs (3 passes), then each draft is
    # the 3 tokens after the latest occurrence of the longest recurring n-gram, accepted, + 1,
    # the last one cut to the 1 token left: 17 tokens in 7 passes.
    looping = ([1, 2, 3], [7, 8, 9] * 6)
    assert spec_bench.draft_ceiling([looping], k=8) == 17 / 7


def test_the_draft_ceiling_at_a_concurrency_drafts_only_from_what_peers_generated_already() -> None:
    fresh = ([1, 2, 3], list(range(10, 18)))
    # Both in flight at once, in lockstep: neither is ever ahead of the other.
    assert spec_bench.draft_ceiling([fresh, fresh], k=4, concurrency=2) == 1.0
    # The second answer is the first's two tokens late: once its last 4-gram (10, 11, 12, 13)
    # is one the first has generated, it drafts the first's 2 tokens beyond it and catches up,
    # then runs in lockstep: 19 + 21 tokens in 38 passes.
    ahead = ([1, 2, 3], list(range(10, 30)))
    late = ([4, 5, 6], [90, 91, *range(10, 30)])
    assert spec_bench.draft_ceiling([ahead, late], k=4, concurrency=2) == 40 / 38
