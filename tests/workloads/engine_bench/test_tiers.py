"""The tier benchmark's sizing: the working set of a run and the pool a tenth of it."""

from __future__ import annotations

from workloads.engine_bench.runner import RequestRecord, RunResult
from workloads.engine_bench.tiers import working_set


def _record(prompt: list[int], output: list[int]) -> RequestRecord:
    return RequestRecord("s", 0, -1, 0.0, prompt, output, 0, "length", None, 0.0)


def test_the_working_set_counts_each_distinct_prompt_page_once() -> None:
    shared = list(range(32))  # two pages of 16
    run = RunResult(
        [
            _record(shared + [100] * 16 + [1], [7] * 4),  # 3 whole pages, 2 shared
            _record(shared + [200] * 16 + [2], [7] * 4),  # 1 new page
            _record(shared + [100] * 16 + [1], [7] * 40),  # nothing new; longest output
        ],
        wall_s=1.0,
        counters={},
    )
    pages, longest = working_set(run, page_size=16)
    assert pages == 4
    assert longest == -(-(49 + 40) // 16)
