"""Monotone scheduler counters: rates are derived from them, never stored."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    """Totals since the scheduler started; every field only grows.

    ``prompt_tokens`` and ``cached_tokens`` are counted when a request is first admitted
    (``cached_tokens`` = its prompt tokens served from the cache then: the pool's tree, or
    loaded back from host memory or disk, counted apart in ``cached_tokens_host/_disk``), so
    ``cached_tokens / prompt_tokens`` is the hit rate of the admitted requests.
    ``computed_prefill_tokens`` counts every prefill token computed, recomputation after
    preemption included.
    """

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Of cached_tokens, those loaded back from the KV tiers below the pool.
    cached_tokens_host: int = 0
    cached_tokens_disk: int = 0
    cached_tokens_remote: int = 0
    computed_prefill_tokens: int = 0
    generated_tokens: int = 0
    evicted_pages: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    # Waiting requests held back one step because a prefill in flight computes their prefix.
    grouped_deferrals: int = 0
    # Speculative decoding (vLLM's names): verify rows run, draft tokens in them, draft tokens
    # accepted, and accepted tokens by their position in the draft (0 = first).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Rows a request got from an identical request's computation (scheduler/shared_rows.py).
    shared_rows: int = 0

    @property
    def hit_rate(self) -> float:
        """The one place the hit rate is derived."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens verified (0 when nothing was drafted)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def cached_tokens_pool(self) -> int:
        """Prompt tokens served from the pool's tree (the rest of cached_tokens was loaded)."""
        below = self.cached_tokens_host + self.cached_tokens_disk + self.cached_tokens_remote
        return self.cached_tokens - below
