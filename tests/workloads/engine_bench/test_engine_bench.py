"""A tiny bench run on the real bundled model (float32: bit-stable greedy answers)."""

from __future__ import annotations

import msgspec
import pytest

from workloads.engine_bench import bench
from workloads.engine_bench.runner import run_trace

TINY = ["--set", "groups=2", "--set", "prompts_per_group=3", "--set", "prefix_tokens=96",
        "--set", "question_tokens=20", "--set", "max_new_tokens=4"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--workload", "shared-prefix", *TINY, "--compare", "--repeats", "1",
            "--baseline-requests", "1", "--dtype", "float32", "--device", "cpu", "--quiet",
            "--json", str(out / "bench.json"), "--plot", str(out / "plots")]
    return bench.main(args), out


def test_cache_on_serves_the_shared_prefixes_and_off_serves_nothing(report):
    result, _ = report
    [workload] = result.workloads
    by_name = {c.config.name: c.median for c in workload.configs}
    assert by_name["off"].cached_tokens == 0
    assert by_name["off"].computed_prefill_tokens == by_name["off"].prompt_tokens
    on = by_name["on"]
    assert on.requests == 6 and on.prompt_tokens == by_name["off"].prompt_tokens
    # 2 groups x 3 prompts: the 2 later prompts of each group can reuse the ~96-token prefix.
    assert 3 * 64 / on.prompt_tokens <= on.ideal_hit_rate <= 4 * 96 / on.prompt_tokens
    assert on.cached_tokens >= 3 * 64
    assert on.computed_prefill_tokens == on.prompt_tokens - on.cached_tokens


def test_cache_never_changes_a_greedy_answer(report):
    result, _ = report
    [workload] = result.workloads
    on = next(c for c in workload.configs if c.config.name == "on")
    assert on.same_outputs_as_off == 1.0
    assert workload.baseline is not None and workload.baseline.same_outputs_as_engine == 1.0


def test_results_are_written_as_json_and_png(report):
    result, out = report
    decoded = msgspec.json.decode((out / "bench.json").read_bytes(), type=bench.BenchReport)
    assert decoded.workloads[0].configs[0].config == result.workloads[0].configs[0].config
    for name in ("hit_rate.png", "throughput.png", "ttft-shared-prefix.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_closed_loop_chat_carries_each_reply_into_the_next_turn(tokenizer):
    from engine import Engine
    from workloads.traces.generators import generate

    trace = generate("chat", tokenizer, 0, overrides={
        "users": 2, "turns": 2, "system_tokens": 48, "user_tokens": 16, "max_new_tokens": 6})
    with Engine(device="cpu", dtype="float32", num_pages=64) as engine:
        result = run_trace(engine, trace, tokenizer)
    records = {(r.session, r.turn): r for r in result.records}
    assert len(records) == 4
    for user in ("user0", "user1"):
        first, second = records[(user, 0)], records[(user, 1)]
        carried = first.prompt_ids + first.output_ids
        assert second.prompt_ids[: len(carried)] == carried
        assert second.cached_tokens >= (len(carried) - 1) // 16 * 16 - 16
    assert [r.turn for r in result.records].index(1) >= 2  # both first turns were sent first
