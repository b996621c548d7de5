"""Which replica serves a request: the routing policies, free of Ray so that the simulator
and the Ray Serve router run the very same code.

Every policy sees a ``RouteRequest`` (the prompt's token ids, its namespace) and the
replicas' current loads (requests queued or running), and names one replica.

- ``CacheAware`` (ours): the replica whose cached prefix of the prompt's page-hash chain saves
  the most recomputation, from the replicas' KV events (``KVIndex``): a page in the pool
  counts whole, one in host memory or on disk less its load (``tier_cost.TierCost``), so for
  one prefix device > host > disk > none. A page some replica knows to be in the remote store
  (``--kv-remote``) is held by every replica at the remote tier's cost, and replicas within
  that cost of the best (``remote`` x the shared pages) all count as holding the prefix: a
  shared document never outweighs a queue. Among holders, the less loaded wins, then the one
  saving more, then the one sent fewer requests lately, then the one holding fewer pool pages. A prefix taking a
  share ``s`` of the recent requests (decayed counts, half-life ``window_s``) may live on
  ``ceil(s * N * (1 + spread))`` replicas: while it has fewer copies and a replica without
  it is less busy than all that have it, the request goes there and makes one more copy
  (only past ``HOT_MIN_REQUESTS`` recent requests: a share of little traffic is noise).
  Without this a hot prefix pins one replica while the queues stay short. When the chosen
  replica's queue exceeds the least loaded one's by more than ``balance_threshold`` and is
  more than ``balance_ratio`` times it, the least loaded of two random choices instead
  (under a burst every queue is long: 28 against 24 is no reason to recompute a prefix). Requests routed in the last
  ``pending_ttl_s`` count as held by their replica until its events catch up, so a burst of
  one new prefix lands together.
- ``TextPrefixAffinity``: what text-prefix routers do (SGLang's ``cache_aware``, Ray Serve
  LLM's ``PrefixCacheAffinityRouter``): an approximate tree of the prompts each replica was
  sent, matched character by character (token by token here), with no knowledge of
  eviction; below a match-rate threshold, the replica whose tree is smallest.
- ``RoundRobin`` and ``LeastLoaded``: the load-only baselines.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cluster.events import PageTier
from cluster.index import KVIndex
from cluster.tier_cost import TierCost
from radix.hashing import namespace_seed, page_hashes


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows of a request: its prompt tokens (tokenized once, at the router)."""

    token_ids: Sequence[int]
    namespace: str | None = None


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, loads: Mapping[str, int]) -> str:
        """One of ``loads``' keys (the replicas that may take the request now)."""
        ...


def least_loaded(replicas: Sequence[str], loads: Mapping[str, int], rng: random.Random) -> str:
    """The least loaded of ``replicas``; ties broken at random."""
    low = min(loads[r] for r in replicas)
    return rng.choice([r for r in replicas if loads[r] == low])


def two_choices(loads: Mapping[str, int], rng: random.Random) -> str:
    """The less loaded of two replicas picked at random (power of two choices)."""
    names = list(loads)
    if len(names) <= 2:
        return least_loaded(names, loads, rng)
    return least_loaded(rng.sample(names, 2), loads, rng)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, loads: Mapping[str, int]) -> str:
        names = sorted(loads)
        chosen = names[self._next % len(names)]
        self._next += 1
        return chosen


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, loads: Mapping[str, int]) -> str:
        return least_loaded(list(loads), loads, self._rng)


def reusable_chain(tokens: Sequence[int], page_size: int, namespace: str | None) -> list[int]:
    """The page-hash chain of the whole pages of ``tokens`` a replica could reuse: never the
    last token (its logits are needed)."""
    usable = max(0, len(tokens) - 1)
    return page_hashes(tokens[: usable - usable % page_size], page_size, namespace)


HOT_MIN_REQUESTS = 3  # a prefix seen fewer times lately is never copied (its share is noise)
DEFAULT_TIER_COST = TierCost()


class CacheAware:
    """Most recomputation saved by a cached prefix (by page hash, weighed by where its pages
    are), hot prefixes copied by their share of traffic, bounded by a load-balance threshold.

    ``tier_cost=None`` counts pool pages only: a page below the pool is a miss (the router
    before the events said where pages are; kept to measure against)."""

    name = "cache_aware"

    def __init__(
        self,
        index: KVIndex,
        page_size: int,
        balance_threshold: int = 4,
        pending_ttl_s: float = 2.0,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        spread: float = 0.2,
        window_s: float = 60.0,
        max_tracked: int = 1 << 16,
        balance_ratio: float = 1.5,
        tier_cost: TierCost | None = DEFAULT_TIER_COST,
    ) -> None:
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold: must be >= 0, got {balance_threshold}")
        if spread < 0:
            raise ValueError(f"spread: must be >= 0, got {spread}")
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        if balance_ratio < 1:
            raise ValueError(f"balance_ratio: must be >= 1, got {balance_ratio}")
        self.balance_ratio = balance_ratio
        self.tier_cost = tier_cost
        self.index = index
        self.page_size = page_size
        self.balance_threshold = balance_threshold
        self.pending_ttl_s = pending_ttl_s
        self.spread = spread
        self.window_s = window_s
        self.max_tracked = max_tracked
        self._rng = random.Random(seed)
        self._clock = clock
        # Recently routed chains not yet confirmed by events: hash -> (replica, expiry).
        self._pending: OrderedDict[int, tuple[str, float]] = OrderedDict()
        # Decayed request counts (count, as of when): per replica, per reused prefix, in all.
        self._recent: dict[str, tuple[float, float]] = {}
        self._traffic: OrderedDict[int, tuple[float, float]] = OrderedDict()
        self._total = (0.0, 0.0)
        self.balanced = 0  # requests sent away from their best match for queue load
        self.copied = 0  # requests that put a hot prefix on one more replica

    def hashes(self, request: RouteRequest) -> list[int]:
        """The chain of the whole pages the replica could reuse (never the last token)."""
        return reusable_chain(request.token_ids, self.page_size, request.namespace)

    def prefix_pages(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Leading pages each replica holds (per the index) or was just sent (pending)."""
        return {r: len(run) for r, run in self.prefix_runs(hashes, replicas).items()}

    def prefix_runs(
        self, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, list[PageTier]]:
        """Where each replica holds the leading pages of ``hashes`` (per the index; below the
        pool only with a ``tier_cost``); pages it was just sent (pending) count as in its pool."""
        runs = self.index.prefix_tiers(hashes, below=self.tier_cost is not None, replicas=replicas)
        now = self._clock()
        pending = self._pending
        while pending:
            first = next(iter(pending.values()))
            if first[1] > now:
                break
            pending.popitem(last=False)
        run: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = pending.get(h)
            if held is None:
                break
            if run.get(held[0], 0) == i:
                run[held[0]] = i + 1
        for replica, n in run.items():
            runs[replica] = [PageTier.DEVICE] * n + runs.get(replica, [])[n:]
        return {r: runs.get(r, []) for r in replicas}

    def choose(self, request: RouteRequest, loads: Mapping[str, int]) -> str:
        hashes = self.hashes(request)
        replicas = list(loads)
        runs = self.prefix_runs(hashes, replicas)
        depth = {r: len(run) for r, run in runs.items()}
        cost = self.tier_cost or DEFAULT_TIER_COST  # without one, every run is in the pool
        saved = {r: cost.saved(run) for r, run in runs.items()}
        now = self._clock()
        recent = {r: self._decayed(self._recent.get(r), now) for r in replicas}

        def rank(r: str) -> tuple[int, float, int]:
            return loads[r], recent[r], self.index.held(r)

        def pick(r: str) -> tuple[int, float, float, int]:
            """Among holders (their savings within the store's cost of each other): the
            less loaded, then the one saving more (its own copy beats the store's)."""
            return loads[r], -saved[r], recent[r], self.index.held(r)

        best = max(saved.values())
        # Every replica can load the shared pages: being within their remote cost of the best
        # is holding the prefix (the replicas then differ by a few percent of its compute).
        slack = cost.remote * self.index.shared_pages(hashes) if self.tier_cost else 0.0
        holders = [r for r in replicas if saved[r] >= best - slack - 1e-9]
        # The request loads every cached prefix it extends (a session's next turn loads its
        # tenant's system prompt too): count it under each, decide on the deepest.
        total = self._decayed(self._total, now) + 1.0
        self._total = (total, now)
        count = 0.0
        for d in sorted({d for d in depth.values() if d}):
            count = self._count_traffic(hashes[d - 1], now)
        share = count / total
        if best and len(holders) < len(replicas) and count >= HOT_MIN_REQUESTS:
            # A hot prefix gets one more copy, on the least busy replica without it, while it
            # has fewer copies than its share of traffic calls for, or while every replica
            # holding it is over the cap of recent requests. Cold prefixes always stay.
            copies = math.ceil(share * len(replicas) * (1 + self.spread))
            cap = sum(recent.values()) / len(replicas) * (1 + self.spread) + 1.0
            if len(holders) < copies or all(recent[r] > cap for r in holders):
                newcomer = min((r for r in replicas if r not in holders), key=rank)
                if rank(newcomer) < min(rank(r) for r in holders):
                    holders = [newcomer]
                    self.copied += 1
        low = min(pick(r) for r in holders)
        chosen = self._rng.choice([r for r in holders if pick(r) == low])
        least = min(loads.values())
        if (
            loads[chosen] - least > self.balance_threshold
            and loads[chosen] > self.balance_ratio * least
        ):
            self.balanced += 1
            chosen = two_choices(loads, self._rng)
        self._recent[chosen] = (recent[chosen] + 1.0, now)
        self._remember(hashes, chosen)
        return chosen

    def _decayed(self, entry: tuple[float, float] | None, now: float) -> float:
        if entry is None:
            return 0.0
        count, when = entry
        return count * 0.5 ** ((now - when) / self.window_s)

    def _count_traffic(self, key: int, now: float) -> float:
        """Count one request reusing ``key``; returns its recent requests."""
        count = self._decayed(self._traffic.pop(key, None), now) + 1.0
        self._traffic[key] = (count, now)
        if len(self._traffic) > self.max_tracked:
            self._traffic.popitem(last=False)
        return count

    def _remember(self, hashes: Sequence[int], replica: str) -> None:
        if self.pending_ttl_s <= 0:
            return
        expiry = self._clock() + self.pending_ttl_s
        pending = self._pending
        for h in hashes:
            pending[h] = (replica, expiry)
            pending.move_to_end(h)


class _TrieNode:
    __slots__ = ("children", "last_used")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.last_used = 0


class TextPrefixAffinity:
    """An approximate prefix tree per replica of the prompts it was sent (no eviction
    events), after the text-prefix routers; prompts are matched token by token."""

    name = "text_prefix"

    def __init__(
        self,
        match_threshold: float = 0.1,
        imbalance_threshold: float = float("inf"),
        max_tokens_per_replica: int | None = None,
        seed: int = 0,
    ) -> None:
        self.match_threshold = match_threshold
        self.imbalance_threshold = imbalance_threshold
        self.max_tokens = max_tokens_per_replica
        self._rng = random.Random(seed)
        self._trees: dict[str, _TrieNode] = {}
        self._sizes: dict[str, int] = {}
        self._tick = 0

    def choose(self, request: RouteRequest, loads: Mapping[str, int]) -> str:
        tokens = list(request.token_ids)
        if request.namespace is not None:  # tenants' trees never meet
            tokens = [-1 - namespace_seed(request.namespace) % (1 << 30), *tokens]
        replicas = list(loads)
        if max(loads.values()) - min(loads.values()) > self.imbalance_threshold:
            chosen = two_choices(loads, self._rng)
        else:
            matched = {r: self._match(r, tokens) for r in replicas}
            best = max(matched.values())
            if tokens and best / len(tokens) >= self.match_threshold:
                chosen = least_loaded([r for r in replicas if matched[r] == best], loads, self._rng)
            else:
                small = min(self._sizes.get(r, 0) for r in replicas)
                chosen = self._rng.choice([r for r in replicas if self._sizes.get(r, 0) == small])
        self._insert(chosen, tokens)
        return chosen

    def _match(self, replica: str, tokens: Sequence[int]) -> int:
        node = self._trees.get(replica)
        n = 0
        while node is not None and n < len(tokens):
            node = node.children.get(tokens[n])
            if node is not None:
                n += 1
        return n

    def _insert(self, replica: str, tokens: Sequence[int]) -> None:
        self._tick += 1
        node = self._trees.setdefault(replica, _TrieNode())
        added = 0
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _TrieNode()
                added += 1
            child.last_used = self._tick
            node = child
        self._sizes[replica] = self._sizes.get(replica, 0) + added
        if self.max_tokens is not None and self._sizes[replica] > self.max_tokens:
            self._trim(replica)

    def _trim(self, replica: str) -> None:
        """Drop least recently used leaves until the tree is back under its budget."""
        assert self.max_tokens is not None
        root = self._trees[replica]
        while self._sizes[replica] > self.max_tokens:
            leaves: list[tuple[int, _TrieNode, int]] = []
            stack = [root]
            while stack:
                node = stack.pop()
                for token, child in node.children.items():
                    if child.children:
                        stack.append(child)
                    else:
                        leaves.append((child.last_used, node, token))
            leaves.sort(key=lambda item: item[0])
            for _, parent, token in leaves[: max(1, len(leaves) // 4)]:
                del parent.children[token]
                self._sizes[replica] -= 1
                if self._sizes[replica] <= self.max_tokens:
                    break

    def tree_tokens(self, replica: str) -> int:
        return self._sizes.get(replica, 0)


POLICY_NAMES = ("round_robin", "least_loaded", "text_prefix", "cache_aware")
