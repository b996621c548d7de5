"""`make demo` end to end, shrunk: both jobs run with the cache on and off and agree."""

from __future__ import annotations

import pytest

from workloads import demo


def test_demo_runs_both_jobs_with_the_cache_on_and_off(capsys: pytest.CaptureFixture[str]) -> None:
    rows = demo.main(["--doc-tokens", "60", "--max-new-tokens", "4", "--threads", "1"])
    by_job = {(r.job, r.cache): r for r in rows}
    assert {cache for _, cache in by_job} == {"on", "off"}
    for (job, cache), row in by_job.items():
        assert row.requests > 0 and row.prompt_tokens > 0
        if cache == "off":
            assert row.cached_tokens == 0
        else:  # the same prompts, now served partly from the cache
            assert 0 < row.cached_tokens < row.prompt_tokens
            assert row.prompt_tokens == by_job[(job, "off")].prompt_tokens
    printed = capsys.readouterr().out
    assert "users at once" in printed and "speedup" in printed
