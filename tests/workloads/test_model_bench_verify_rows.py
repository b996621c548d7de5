"""``model_bench --verify-rows``: the pass-cost table the speculation figures quote."""

from __future__ import annotations

from workloads.model_bench.cpu import main


def test_verify_rows_prints_a_pass_time_per_requests_rows_and_context(capsys) -> None:
    main(["--verify-rows", "1", "3", "--decode-batch", "1", "2", "--verify-context", "16", "40",
          "--repeats", "1", "--dtype", "float32"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[2:]
    assert "1 row/request" in header and "3 rows/request" in header
    assert [tuple(r.split("|")[1:3]) for r in rows] == [
        (" 16 ", " 1 "), (" 16 ", " 2 "), (" 40 ", " 1 "), (" 40 ", " 2 ")]
    for row in rows:
        ms = [float(cell) for cell in row.strip("| ").split("|")[2:4]]
        assert all(m > 0 for m in ms)
