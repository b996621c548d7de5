"""Scheduler knobs, validated once so the scheduler never has to second-guess them."""

from __future__ import annotations

import numbers

import msgspec

POLICIES = ("fcfs", "lpm", "dfs-weight")
SCHEDULING_POLICIES = ("fcfs", "priority")
# The most one step of priority may be worth in waiting (an hour): beyond it aging is off in
# all but name, which ``priority_aging_seconds=0`` says plainly.
MAX_PRIORITY_AGING_S = 3600.0
SPECULATION = ("off", "tree")
MAX_SPECULATIVE_TOKENS = 32


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How much work one step may hold and how waiting requests are ordered.

    Defaults suit a CPU engine: a 1,024-token step keeps one forward pass of a ~100M-parameter
    model well under a second on a few cores, so decodes sharing the step with a prefill chunk
    are not stalled for long; 64 running requests already saturate a CPU decode step while
    keeping the KV a decode batch pins modest.
    """

    page_size: int = 16
    # Tokens per forward pass: decodes (one each) plus prefill chunks.
    max_batch_tokens: int = 1024
    # Requests holding pages at once (prefilling or decoding).
    max_running: int = 64
    policy: str = "lpm"
    # False: nothing is inserted into the tree and nothing is grouped, so no request ever
    # reuses another's KV (the baseline benchmarks compare against).
    prefix_cache: bool = True
    # In-batch grouping: a waiting request whose uncached prefix shares at least this many
    # tokens (rounded up to whole pages) with a prefill in flight waits for it and then hits.
    group_min_tokens: int = 32
    # Decode reserve: admission sets aside ratio * (max_new_tokens - generated) tokens per
    # request. The ratio tracks the observed fraction of max_new_tokens that requests really
    # generate (moving average, ``reserve_ratio_init`` before any request finished), plus
    # ``reserve_margin``; a preemption raises it to 1.0, from where it decays by
    # ``reserve_decay`` per step.
    reserve_ratio_init: float = 0.7
    reserve_ratio_min: float = 0.05
    reserve_margin: float = 0.1
    reserve_decay: float = 0.005
    # Waiting requests examined per step beyond those admitted (bounds the cost of a step
    # when thousands of requests wait behind in-flight prefixes).
    max_lookahead: int = 256
    # Speculative decoding without a draft model ("tree": drafts from the radix tree's
    # continuations and n-gram lookups, verified in the decode step; scheduler/speculation/), at
    # most ``num_speculative_tokens`` draft tokens per request and step (the gate picks fewer).
    speculation: str = "off"
    num_speculative_tokens: int = 8
    # Identical requests in flight together (same namespace, tokens and deterministic
    # sampling) compute their rows once (scheduler/shared_rows.py). Exact only where a row does not
    # depend on its pass: the engine turns it off where passes are not batch-invariant.
    share_rows: bool = True
    # vLLM's: "fcfs" (the default) refuses a request whose ``SamplingParams.priority`` is not
    # 0, so no client can place itself ahead of others; "priority" admits by priority (lower
    # first), then by ``policy``.
    scheduling_policy: str = "fcfs"
    # Aging by wall time: one step of priority is worth this many seconds of waiting (since
    # ``Request.arrival_time``). A request is never overtaken by one that arrived more than
    # (its priority - the other's) x this later: with 0.01 and priorities in [-1000, 1000],
    # a flood holds no request for more than 20 s of its arrivals. 0: no aging (strict
    # priority; a low one may starve).
    priority_aging_seconds: float = 0.01

    def __post_init__(self) -> None:
        _positive_int("page_size", self.page_size)
        _positive_int("max_batch_tokens", self.max_batch_tokens)
        _positive_int("max_running", self.max_running)
        _positive_int("max_lookahead", self.max_lookahead)
        if self.max_running > self.max_batch_tokens:
            raise ValueError(
                f"max_running: must be <= max_batch_tokens ({self.max_batch_tokens}) so every "
                f"running request can decode in one step, got {self.max_running}"
            )
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache: must be a bool, got {self.prefix_cache!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                f"{self.scheduling_policy!r}"
            )
        aging = self.priority_aging_seconds
        if not _is_real(aging) or not 0.0 <= aging <= MAX_PRIORITY_AGING_S:
            raise ValueError(
                f"priority_aging_seconds: must be a number of seconds in "
                f"[0, {MAX_PRIORITY_AGING_S:g}], got {aging!r}"
            )
        if not isinstance(self.share_rows, bool):
            raise ValueError(f"share_rows: must be a bool, got {self.share_rows!r}")
        if self.speculation not in SPECULATION:
            raise ValueError(
                f"speculation: must be one of {', '.join(SPECULATION)}, got {self.speculation!r}"
            )
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens: must be an int in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {n!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if (
            not isinstance(self.group_min_tokens, int)
            or isinstance(self.group_min_tokens, bool)
            or self.group_min_tokens < 0
        ):
            raise ValueError(f"group_min_tokens: must be an int >= 0, got {self.group_min_tokens!r}")
        for name in ("reserve_ratio_init", "reserve_ratio_min", "reserve_margin", "reserve_decay"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}")

    @property
    def group_min_pages(self) -> int:
        """group_min_tokens in whole pages (at least one)."""
        return max(1, -(-self.group_min_tokens // self.page_size))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
