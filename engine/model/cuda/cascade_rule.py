"""When attending a shared prefix once (cascade) beats attending it once per request.

On a GPU the cascade was found slower than plain decode at every batch size measured
(docs/gpu.md): it saves KV reads, but per layer it adds a shared call, the gather of its
queries and a merge per level with its scatters, each a kernel launch on a host-bound step,
and its shared call has few work units (a handful of query rows per KV head) where plain decode spreads the
same bytes over every SM. So the cascade is taken only where an estimate says it wins by a
margin: bytes over bandwidth at the occupancy each call reaches, plus the launches it adds.
A pure function of the pass's shape and a few device figures (``CascadeCosts``), measured
by ``workloads.model_bench.gpu``'s shared-prefix rows.
"""

from __future__ import annotations

import msgspec

# FlashInfer's prefill tiles: query rows per work unit, and the KV tokens one unit reads
# before the split-KV scheduler cuts a long KV (its order of magnitude; estimates only).
QUERY_TILE = 128
KV_CHUNK_TOKENS = 1024
# Kernels the cascade adds per layer: the shared call and its queries' gather, then per
# level a merge, two gathers and two scatters.
LAUNCHES_FIXED = 2
LAUNCHES_PER_LEVEL = 5


class CascadeCosts(msgspec.Struct, frozen=True):
    """Device figures of the estimate: attention's achieved bandwidth, the SM count, the
    cost of one more kernel in an eager pass, and how much faster the cascade must be."""

    bandwidth: float = 3.0e12  # bytes/s
    num_sms: int = 132
    launch_seconds: float = 8e-6
    margin: float = 1.5


DEFAULT_COSTS = CascadeCosts()  # an H100/H200-class device


class SharedRun(msgspec.Struct, frozen=True):
    """Pages several requests hold at the same positions: how many requests, how many KV
    tokens, and their query rows in the pass."""

    members: int
    tokens: int
    queries: int


def _seconds(nbytes: float, units: int, costs: CascadeCosts) -> float:
    """Reading ``nbytes`` with ``units`` parallel work units (fewer than the SMs: slower)."""
    occupancy = min(1.0, max(units, 1) / costs.num_sms)
    return nbytes / (costs.bandwidth * occupancy)


def cascade_pays(
    runs: list[SharedRun],
    levels: int,
    kv_heads: int,
    group: int,
    bytes_per_token: int,
    costs: CascadeCosts = DEFAULT_COSTS,
) -> bool:
    """True where attending ``runs`` once (``levels`` of nesting) is estimated ``margin``
    times faster, per layer, than every member reading them in its own call.
    ``bytes_per_token``: one token's K and V over all KV heads of one layer."""
    if not runs:
        return False
    plain_bytes = sum(r.members * r.tokens for r in runs) * bytes_per_token
    # Plain decode splits each member's KV into chunks, so it fills the device.
    plain_units = sum(
        r.members * kv_heads * -(-r.tokens // KV_CHUNK_TOKENS) for r in runs
    )
    plain = _seconds(plain_bytes, plain_units, costs)
    shared_units = sum(
        kv_heads * -(-(r.queries * group) // QUERY_TILE) * -(-r.tokens // KV_CHUNK_TOKENS)
        for r in runs
    )
    shared = _seconds(sum(r.tokens for r in runs) * bytes_per_token, shared_units, costs)
    launches = LAUNCHES_FIXED + LAUNCHES_PER_LEVEL * levels
    cascade = shared + launches * costs.launch_seconds
    return cascade * costs.margin <= plain
