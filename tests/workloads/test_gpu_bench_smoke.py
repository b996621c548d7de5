"""``workloads.model_bench.gpu`` runs on a lent GPU for a few scarce minutes; a crash there (the
first run lost its model section to a renamed attribute) costs a call. ``--smoke`` runs every
section's code at tiny sizes on the CPU, through FlashInfer's torch reference, here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from workloads.checkpoints.random_model import build, pack_front
from workloads.model_bench import gpu


def test_every_section_of_the_gpu_bench_runs_and_the_defaults_are_exact(
    tmp_path: Path, capsys: Any
) -> None:
    model = build(pack_front(tmp_path / "front"), tmp_path / "tiny", "tiny", seed=1)
    gpu.main(["--smoke", "--model", str(model), "--exactness-model", str(model)])
    out = capsys.readouterr().out
    assert "failed" not in out, out
    titles = re.findall(r"^### (.+)$", out, flags=re.M)
    assert [t.split(" ")[0] for t in titles] == [
        "Exactness", "Whole", "Verify", "Shared-prefix", "Where", "Decode"
    ], titles
    n = gpu.SMOKE.exact_on_shared + gpu.SMOKE.exact_own
    defaults = [line for line in out.splitlines() if line.startswith("| defaults")]
    assert len(defaults) == 4 and all(f"| {n}/{n}" in line for line in defaults), defaults
    # a row per decode mode and shape, each with its floor ratio
    decode_rows = [line for line in out.splitlines() if line.startswith("| decode, own pages")]
    assert len(decode_rows) == len(gpu.DECODE_MODES) * len(gpu.SMOKE.decode_shapes)
    assert all(re.search(r"\| [0-9.]+x \|$", line) for line in decode_rows), decode_rows
    # verify passes ran in their graphs (no "ran eager" row) and eagerly
    verify = [line for line in out.splitlines() if line.startswith("| verify")]
    assert len(verify) == 2 * len(gpu.SMOKE.verify_shapes) * len(gpu.SMOKE.drafts), verify
    assert not any("ran eager" in line for line in verify), verify
