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
