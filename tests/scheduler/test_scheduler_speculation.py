"""Speculative decoding in the scheduler, against a deterministic stand-in model.

``LoopingModel`` 'generates' a token that is a function of the last three tokens of the
sequence over a small alphabet, so sequences repeat and drafts get accepted; it verifies a
draft as the engine's runner does (row j sampled after the first j drafts, accepted while
equal). It plays the KV pool like the scripted model: every slot holds a content address of
its prefix, and every slot a request reads must hold its own tokens' address, so a rejected
draft's K/V that reached the tree, or a page freed too early, fails the test.

Pinned: outputs with speculation (and with shared rows) equal outputs without (under chunked
prefill, preemption,
tiny pools, several namespaces), every page is accounted for at idle, the tree only ever holds
real sequences, drafts (from the tree, the namespace's index or running peers) never cross
namespaces, and the gate stops drafting where drafts fail.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix import KVManager
from scheduler import Batch, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.speculation.drafter import ContextIndex, Draft, Drafter, DraftSource
from scheduler.speculation.gate import Candidate, SpeculationGate

ALPHABET = 7
STOP = 99


class LoopingModel:
    def __init__(self, page_size: int, stop_after: dict[Any, int] | None = None) -> None:
        self.page_size = page_size
        self.kv: dict[int, int] = {}
        self.stop_after = stop_after or {}

    def next_token(self, request: Request, tokens: list[int]) -> int:
        produced = len(tokens) - len(request.prompt)
        if self.stop_after.get(request.id) == produced:
            return STOP
        a, b, c = ([0, 0, 0] + tokens)[-3:]
        return 10 + (a * 31 + b * 7 + c * 3 + len(tokens) // 50) % ALPHABET

    def step(self, batch: Batch) -> list[list[int]]:
        """As the runner does: every entry that is not a follower computed first (a follower may
        come before its leader in the batch), then each follower given its leader's K/V and
        tokens."""
        p = self.page_size
        computed: dict[int, list[int]] = {}
        for entry in batch.entries:
            if entry.leader is None:
                computed[id(entry)] = self._compute(entry)
        out: list[list[int]] = []
        for entry in batch.entries:
            leader = entry.leader
            if leader is None:
                out.append(computed[id(entry)])
                continue
            request, lead = entry.request, leader.request
            tokens = request.prompt + request.output + entry.draft
            assert entry.input_ids == tokens[entry.start_pos : entry.kv_len]
            assert tokens == lead.prompt + lead.output + leader.draft
            assert request.namespace == lead.namespace
            for pos, dst in zip(range(entry.start_pos, entry.kv_len), entry.slots):
                self.kv[dst] = self.kv[leader.pages[pos // p] * p + pos % p]
            known = entry.draft[: leader.start_pos - entry.start_pos]
            out.append(known + computed[id(leader)])
        return out

    def _compute(self, entry: Any) -> list[int]:
        p = self.page_size
        request = entry.request
        tokens = request.prompt + request.output + entry.draft
        assert entry.input_ids == tokens[entry.start_pos : entry.kv_len]
        address = 0
        for pos in range(entry.kv_len):
            address = hash((address, tokens[pos]))
            slot = entry.pages[pos // p] * p + pos % p
            if pos < entry.start_pos:
                assert self.kv.get(slot) == address, f"{request.id} reads foreign K/V at {pos}"
            else:
                self.kv[slot] = address
        if not entry.sample:
            return []
        base = request.prompt + request.output
        accepted: list[int] = []
        for j in range(len(entry.draft) + 1):
            token = self.next_token(request, base + entry.draft[:j])
            accepted.append(token)
            if j == len(entry.draft) or token != entry.draft[j]:
                break
        return accepted


def run(
    prompts: list[tuple[list[int], str | None]],
    speculation: str,
    *,
    page_size: int,
    num_pages: int,
    max_batch_tokens: int,
    max_new: int,
    k: int = 8,
    stop_after: dict[Any, int] | None = None,
    max_running: int = 8,
    share_rows: bool = True,
) -> tuple[dict[Any, tuple[list[int], str | None]], Scheduler]:
    kv = KVManager(num_pages, page_size)
    config = SchedulerConfig(
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        max_running=min(max_running, max_batch_tokens),
        speculation=speculation,
        num_speculative_tokens=k,
        reserve_ratio_init=0.0,
        reserve_ratio_min=0.0,
        reserve_margin=0.0,
        share_rows=share_rows,
    )
    sched = Scheduler(kv, config)
    # The stand-in's tokens must be a function of the sequence, as a real model's are
    # (followers get their leader's tokens): requests with one prompt in one namespace stop alike.
    first = {}
    for i, (prompt, namespace) in enumerate(prompts):
        first.setdefault((tuple(prompt), namespace), i)
    stops = {i: (stop_after or {}).get(first[(tuple(p), ns)]) for i, (p, ns) in enumerate(prompts)}
    model = LoopingModel(page_size, {i: n for i, n in stops.items() if n is not None})
    requests = []
    for i, (prompt, namespace) in enumerate(prompts):
        # Greedy: identical requests in flight together share rows (the leader computes).
        params = SamplingParams(max_new_tokens=max_new, stop_token_ids=[STOP], temperature=0.0)
        request = Request(i, list(prompt), params, namespace)
        sched.add(request)
        requests.append(request)
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None
        assert batch.num_tokens <= max_batch_tokens
        sched.commit(batch, model.step(batch))
        sched.observe_step(batch, 0.010 + 0.001 * batch.num_tokens)
        sched.check_integrity()
        steps += 1
        assert steps < 20_000
    stats = kv.stats()
    assert stats.free + stats.cached == stats.total, "pages lost at idle"
    assert_tree_holds_only(kv, requests)
    return {r.id: (r.output, r.finish_reason) for r in requests}, sched


def assert_tree_holds_only(kv: KVManager, requests: list[Request]) -> None:
    """Every path in the tree is a prefix of some request's prompt + output, in its namespace."""
    sequences = [(r.namespace, r.prompt + r.output) for r in requests]
    tree = kv.tree
    for namespace in tree.namespaces:
        stack = [(tree.root(namespace), [])]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                path = prefix + child.tokens
                assert any(
                    ns == namespace and seq[: len(path)] == path for ns, seq in sequences
                ), "the tree holds tokens no request had (a rejected draft?)"
                stack.append((child, path))


prompt_st = st.lists(st.integers(min_value=10, max_value=10 + ALPHABET - 1), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(
        st.tuples(prompt_st, st.sampled_from([None, "a"])), min_size=1, max_size=6
    ),
    repeat=st.booleans(),
    page_size=st.sampled_from([1, 4]),
    pool_tokens=st.integers(min_value=60, max_value=200),
    max_batch_tokens=st.integers(min_value=4, max_value=40),
    max_new=st.integers(min_value=1, max_value=30),
    k=st.integers(min_value=1, max_value=8),
    stops=st.dictionaries(st.integers(0, 11), st.integers(0, 29), max_size=3),
)
def test_outputs_with_speculation_equal_outputs_without(
    prompts: list[tuple[list[int], str | None]],
    repeat: bool,
    page_size: int,
    pool_tokens: int,
    max_batch_tokens: int,
    max_new: int,
    k: int,
    stops: dict[int, int],
) -> None:
    if repeat:  # the same prompts again: the tree holds their continuations
        prompts = prompts + prompts
    pool_tokens = max(pool_tokens, max(len(p) for p, _ in prompts) + max_new + page_size)
    knobs = dict(
        page_size=page_size,
        num_pages=pool_tokens // page_size,
        max_batch_tokens=max_batch_tokens,
        max_new=max_new,
        k=k,
        stop_after=stops,
    )
    plain, _ = run(prompts, "off", **knobs, share_rows=False)
    spec, _ = run(prompts, "tree", **knobs)
    assert spec == plain


def test_repeats_are_drafted_and_accepted_in_fewer_steps() -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16] * 4
    prompts = [(prompt, None)] * 3
    knobs = dict(page_size=4, num_pages=200, max_batch_tokens=64, max_new=40, max_running=1)
    plain, off = run(prompts, "off", **knobs)
    spec, on = run(prompts, "tree", **knobs)
    assert spec == plain
    c = on.counters
    assert c.spec_decode_num_drafts > 0
    # The repeats follow the tree whole; the first answer's 1- and 2-token context matches
    # guess a rule of 3 tokens and are often wrong (trying them still pays at batch 1).
    assert c.spec_decode_num_accepted_tokens > 0.6 * c.spec_decode_num_draft_tokens
    assert c.spec_decode_num_accepted_tokens_per_pos[0] >= c.spec_decode_num_accepted_tokens_per_pos[-1]
    assert sum(c.spec_decode_num_accepted_tokens_per_pos) == c.spec_decode_num_accepted_tokens
    assert on.counters.steps < off.counters.steps / 2
    assert off.counters.spec_decode_num_drafts == 0


def test_identical_requests_in_flight_share_their_rows() -> None:
    prompt = [10, 12, 14, 11, 13]
    prompts = [(prompt, "a"), (prompt, "a"), (prompt, "b"), ([11, 12], "a")]
    knobs = dict(page_size=4, num_pages=100, max_batch_tokens=64, max_new=30, max_running=4)
    for speculation in ("off", "tree"):
        apart, separate = run(prompts, speculation, **knobs, share_rows=False)
        together, shared = run(prompts, speculation, **knobs)
        assert together == apart
        assert separate.counters.shared_rows == 0
        # Only requests 0 and 1 (same namespace, same tokens) share rows: at most one row per
        # token the second generates after its first (which its prefill gives).
        assert 0 < shared.counters.shared_rows <= 29 * (1 + 8)


def _drafter_over(seq: list[int], namespace: str) -> tuple[KVManager, Drafter]:
    """A drafter on a fresh manager whose tree holds ``seq`` in ``namespace`` (stored through
    the manager, so the namespace index has seen its ``PagesStored`` events)."""
    kv = KVManager(64, 4)
    drafter = Drafter(kv, 8)
    handle = kv.acquire([], namespace)
    assert kv.allocate(handle, len(seq))
    kv.release(handle, seq)
    return kv, drafter


def test_tree_continuation_is_read_only_within_the_namespace() -> None:
    seq = list(range(100, 124))
    kv, drafter = _drafter_over(seq, "a")
    before = [(p.page, p.key) for p in kv.tree.walk_pages()]
    for namespace, expected in (("a", DraftSource.TREE), ("b", None), (None, None)):
        request = Request(namespace or "none", seq[:8], SamplingParams(max_new_tokens=16), namespace)
        request.output = seq[8:10]
        request.kv = kv.acquire(seq[:8], namespace)
        draft = drafter.propose(request, 5)
        kv.release(request.kv)
        if expected is None:
            assert draft.source is not DraftSource.TREE
            assert draft.source is not DraftSource.NAMESPACE
        else:
            assert draft.source is expected and draft.tokens == seq[10:15]
    assert [(p.page, p.key) for p in kv.tree.walk_pages()] == before


def test_namespace_index_drafts_only_within_its_namespace() -> None:
    seq = list(range(200, 232))
    kv, drafter = _drafter_over(seq, "a")
    assert len(drafter.namespaces) > 0
    for namespace in ("a", "b"):
        # A different start, then an n-gram of the cached sequence: no exact prefix to follow.
        request = Request(namespace, [1, 2, 3] + seq[5:12], SamplingParams(max_new_tokens=8), namespace)
        request.kv = kv.acquire(request.prompt, namespace)
        draft = drafter.propose(request, 4)
        kv.release(request.kv)
        if namespace == "a":
            assert draft == Draft(seq[12:16], DraftSource.NAMESPACE, 4)
        else:
            assert draft.source is None and draft.tokens == []


def test_a_running_request_drafts_what_a_running_peer_of_its_namespace_generated() -> None:
    kv = KVManager(64, 4)
    drafter = Drafter(kv, 8)
    phrase = [50, 51, 52, 53]
    ahead = Request("ahead", [1, 2, 3], SamplingParams(max_new_tokens=32), "a")
    ahead.output = [9, *phrase, 60, 61, 62]
    drafter.sync(ahead)
    for name, namespace in (("behind", "a"), ("stranger", "b")):
        request = Request(name, [4, 5], SamplingParams(max_new_tokens=32), namespace)
        request.output = [8, *phrase]
        draft = drafter.propose(request, 5)
        if namespace == "a":
            assert draft == Draft([60, 61, 62], DraftSource.PEER, 4)
        else:
            assert draft.source is None and draft.tokens == []
        drafter.forget(request)
    drafter.forget(ahead)  # it ended: its answer reaches the drafts through the tree now
    assert len(drafter.peers) == 0
    behind = Request("again", [4, 5], SamplingParams(max_new_tokens=32), "a")
    behind.output = [8, *phrase]
    assert drafter.propose(behind, 5) == Draft([])


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    split=st.integers(0, 60),
    k=st.integers(1, 6),
)
def test_context_index_finds_the_latest_earlier_ngram(tokens: list[int], split: int, k: int) -> None:
    split = min(split, len(tokens) - 1)
    request = Request("r", tokens[: len(tokens) - split], SamplingParams(max_new_tokens=64))
    index = ContextIndex()
    for grow in range(split + 1):  # tokens arrive one by one, as a request decodes
        request.output = tokens[len(request.prompt) : len(request.prompt) + grow]
        index.sync(request)
    assert index.tokens == tokens
    expected: tuple[list[int], int] = ([], 0)
    for n in (4, 3, 2, 1):
        if len(tokens) <= n:
            continue
        query = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == query]
        if starts:
            expected = (tokens[starts[-1] + n : starts[-1] + n + k], n)
            break
    assert index.lookup(k) == expected


def _fitted_gate(a: float, b: float) -> SpeculationGate:
    gate = SpeculationGate()
    for n in (1, 2, 5, 9, 1, 3, 8, 1, 2, 6):
        gate.cost.observe(n, a + b * n)
    return gate


def test_gate_fits_the_step_cost() -> None:
    fit = _fitted_gate(0.006, 0.0009).cost.fit()
    assert fit is not None
    assert abs(fit[0] - 0.006) < 1e-6 and abs(fit[1] - 0.0009) < 1e-7


def test_gate_stops_drafting_when_drafts_are_rejected_and_retries_later() -> None:
    gate = _fitted_gate(0.006, 0.0009)
    request = Request("r", [1], SamplingParams())
    draft = Draft([5, 6, 7, 8], DraftSource.CONTEXT, 4)
    offer = [Candidate(request, draft)]
    assert gate.grant(offer, 1, 1, 100)[0] > 0  # the prior: worth trying at batch 1
    for _ in range(6):
        gate.record(request, draft, 1, 0)
    assert gate.grant(offer, 1, 1, 100) == [0]
    # Unused offers pull the estimate back to the prior: the request is tried again.
    for _ in range(200):
        if gate.grant(offer, 1, 1, 100) != [0]:
            break
    else:
        raise AssertionError("the gate never retried")


def test_a_new_request_is_priced_by_what_its_draft_kind_scored_on_the_traffic() -> None:
    """Other requests' rejected 1-token context matches make a new request's one not worth a
    row at a pass where the constant prior would have paid; other kinds keep their priors; and
    left untried, the traffic's estimate drifts back until the kind is tried again."""
    gate = _fitted_gate(0.006, 0.0009)  # a token pays at acceptance over 0.13
    short = Draft([5, 6], DraftSource.CONTEXT, 1)
    fresh = Request("fresh", [1], SamplingParams())
    assert gate.grant([Candidate(fresh, short)], 1, 1, 100) == [1]  # prior 0.3
    for i in range(20):
        gate.record(Request(i, [1], SamplingParams()), short, 1, 0)
    newcomer = Request("new", [1], SamplingParams())
    assert gate.grant([Candidate(newcomer, short)], 1, 1, 100) == [0]
    long = Draft([5, 6], DraftSource.CONTEXT, 4)
    assert gate.grant([Candidate(newcomer, long)], 1, 1, 100)[0] > 0
    for _ in range(500):
        if gate.grant([Candidate(newcomer, short)], 1, 1, 100) != [0]:
            break
    else:
        raise AssertionError("the traffic's estimate never came back")


def test_gate_grants_nothing_to_a_compute_bound_batch() -> None:
    gate = _fitted_gate(0.001, 0.002)  # each token costs twice a pass's fixed part
    requests = [Request(i, [1], SamplingParams()) for i in range(32)]
    offers = [Candidate(r, Draft([5, 6, 7], DraftSource.CONTEXT, 4)) for r in requests]
    assert gate.grant(offers, 32, 32, 1000) == [0] * 32
    # A weight-bound pass (the fixed part dominates) takes exact repeats whole.
    cheap = _fitted_gate(0.006, 0.0001)
    exact = Draft([5, 6, 7], DraftSource.TREE, 20)
    assert cheap.grant([Candidate(requests[0], exact)], 1, 1, 100) == [3]


def test_gate_respects_the_token_budget() -> None:
    gate = _fitted_gate(0.006, 0.0001)
    requests = [Request(i, [1], SamplingParams()) for i in range(3)]
    offers = [Candidate(r, Draft([5] * 8, DraftSource.TREE, 20)) for r in requests]
    assert sum(gate.grant(offers, 3, 3, 5)) == 5


def test_the_gate_prices_rows_only_from_passes_of_decodes_and_verifies() -> None:
    """A prompt token computes no logits and rides in a taller matrix product: passes with
    prefill in them would make a draft row look cheaper than it is."""
    kv = KVManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(page_size=4, max_batch_tokens=12, max_running=4,
                                          speculation="tree", num_speculative_tokens=4))
    model = LoopingModel(4)
    for i in range(3):
        sched.add(Request(i, [1 + i] * 10, SamplingParams(max_new_tokens=12)))
    decode_only = mixed = 0
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None
        sched.commit(batch, model.step(batch))
        sched.observe_step(batch, 0.010 + 0.001 * batch.num_tokens)
        if all(e.is_decode for e in batch.entries):
            decode_only += 1
        else:
            mixed += 1
    assert mixed > 0 and decode_only > 0
    spec = sched._speculation
    assert spec is not None and spec.gate.cost.passes == decode_only
