"""Is the engine's forward batch-invariant on this device? Checked at start, on its own runner.

On a CPU the dtype probe checks the forward once per machine (``dtype_probe``); on a
GPU the promise rests on FlashInfer's deterministic plan and on cuBLAS giving a row the same
bits whatever the row count, and both depend on the device, the library versions and the
shapes (FlashInfer picks its query tile from the pass's query lengths: flashinfer#2424). So
the engine checks the runner it will serve with, with its graphs and plans, before serving:
one prompt whole, in chunks ending in one-token steps, inside batches beside other requests'
prefills and decodes, and decoded alone and in padded decode batches. Its last token's
logits must be equal bit for bit in every case. A failure warns, is logged and leaves the
engine reporting ``batch_invariant=False`` (speculation and shared rows then stay off),
unless only the graphs' padded decode rows differ: then the graphs are dropped, decode runs
eagerly and the engine stays exact (exactness before speed, with a warning saying so).
"""

from __future__ import annotations

import logging
import warnings

from engine.model.bringup.invariance import OTHERS, PROMPT, InvarianceReport, last_logits
from engine.model.runner import ModelRunner

log = logging.getLogger("radixkv.engine")

# Pages of the runner's pool each case may use: every case splits the pool between its
# requests, and the longest request holds the prompt (67 tokens).
_MIN_TOKENS_PER_REQUEST = 2 * len(PROMPT)


def cases() -> dict[str, list[list[list[int]]]]:
    """Per case, each request's chunks (chunk i of every request in pass i); request 0 is
    the prompt, whose last logits are compared with its whole pass."""
    ids = PROMPT
    n = len(ids)
    a, b = OTHERS
    decoded = [ids[: n - 3], [ids[n - 3]], [ids[n - 2]], [ids[n - 1]]]
    return {
        "whole": [[ids]],
        "chunked": [[ids[:7], ids[7:36], ids[36 : n - 1], ids[n - 1 :]]],
        "beside prefills": [[ids[:36], ids[36:]], [a[:20], a[20:]], [b[:2], b[2:]]],
        "batched whole": [[ids], [a], [b[:1]]],
        "decoded alone": [decoded],
        "decoded in a batch of 3": [decoded, [a[:10], [1], [2], [3]], [b, [4], [5], [6]]],
        "decoded in a batch of 6": [decoded] + [[a[: 5 + i], [i], [i + 1], [i + 2]] for i in range(5)],
        "decoded beside a prefill": [decoded, [a[:3], a[3:9], a[9:30], a[30:]]],
    }


def check_runner(runner: ModelRunner) -> InvarianceReport | None:
    """Runs ``cases()`` on ``runner`` (its pool's pages are overwritten: call before it
    serves); None when its pool is too small to hold them."""
    found = cases()
    widest = max(len(pieces) for pieces in found.values())
    per_request = runner.pool.num_pages // widest * runner.pool.page_size
    if per_request < _MIN_TOKENS_PER_REQUEST:
        return None
    logits = {name: last_logits(runner, pieces, sample_all=True) for name, pieces in found.items()}
    whole = logits.pop("whole")
    failed = tuple(name for name, got in logits.items() if not got.equal(whole))
    return InvarianceReport(not failed, failed, 0.0)


def verify_on_device(runner: ModelRunner) -> bool:
    """Whether ``runner`` (asked to be batch-invariant) is, by ``check_runner``; says why not
    (a warning and the log) when it is not, or could not be checked."""
    if not runner.batch_invariant:
        return False
    report = check_runner(runner)
    device = runner.loaded.device
    if report is not None and not report.invariant and runner.graphs is not None:
        # Exact first: if only the padded graph rows differ, serve eagerly and exactly.
        graphs, runner.graphs = runner.graphs, None
        eager = check_runner(runner)
        if eager is not None and eager.invariant:
            del graphs  # the last reference: drop_graphs then releases their memory
            runner.drop_graphs()
            message = (
                f"cuda_graphs: decode graphs on {device} differ from eager passes "
                f"({', '.join(report.failed)}); they are off, decode steps run eagerly "
                "and batch_invariant holds"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            return True
        runner.graphs = graphs
    if report is None:
        why = "the KV pool is too small to run the check"
    elif not report.invariant:
        why = f"its logits differ ({', '.join(report.failed)})"
    else:
        log.info("batch_invariant: verified on %s (%d cases bit-identical)", device,
                 len(cases()) - 1)
        return True
    message = (
        f"batch_invariant: the forward on {device} was not verified ({why}); greedy answers "
        "may depend on the batch and the cache: reporting batch_invariant=False"
    )
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return False
