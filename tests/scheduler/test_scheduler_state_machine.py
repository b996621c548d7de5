"""The scheduler under random arrivals, shared prefixes, aborts and tiny page pools.

After every step: every page is owned exactly once (free list, tree, or one running
request's private tail), the tree's invariants hold, every running request's page table
matches its locked path, and the scripted model never reads K/V it did not write for
exactly that prefix. At the end every request finishes or is aborted within a bound on the
number of steps, its outputs follow its script in order, a request that asked for its
prompt's log-probabilities had every prompt position scored exactly once, in order, and
none taken from the cache, and free + cached == total.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_harness import STOP, assert_output_follows_script, make_scheduler, run_to_idle

from scheduler import Request, RequestState, SamplingParams

STEMS = [list(range(1000 * k, 1000 * k + 24)) for k in range(1, 4)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        num_pages_tokens=st.integers(min_value=24, max_value=96),
        policy=st.sampled_from(["fcfs", "lpm", "dfs-weight"]),
        max_batch_tokens=st.integers(min_value=6, max_value=24),
        max_running=st.integers(min_value=1, max_value=6),
        group_min_tokens=st.sampled_from([0, 4, 8]),
        reserve=st.sampled_from([0.0, 0.3, 0.7]),
        speculation=st.sampled_from(["off", "tree"]),
    )
    def setup(
        self,
        page_size: int,
        num_pages_tokens: int,
        policy: str,
        max_batch_tokens: int,
        max_running: int,
        group_min_tokens: int,
        reserve: float,
        speculation: str,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages_tokens // page_size
        self.sched, self.model, self.cache, self.allocator = make_scheduler(
            self.num_pages,
            page_size,
            policy=policy,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            group_min_tokens=group_min_tokens,
            # A low decode reserve over-admits on purpose, so decodes run out of pages and
            # preemption happens.
            reserve_ratio_init=reserve,
            reserve_ratio_min=0.0,
            reserve_margin=0.0,
            speculation=speculation,
            num_speculative_tokens=4,
            scheduling_policy="priority",
            priority_aging_seconds=0.0005,  # priority levels reorder as they age
        )
        self.requests: list[Request] = []
        self.next_id = 0
        self.work_tokens = 0  # bound on the work left: prompts + outputs, with preemptions

    @rule(
        stem=st.integers(min_value=-1, max_value=len(STEMS) - 1),
        stem_len=st.integers(min_value=0, max_value=24),
        suffix=st.lists(st.integers(min_value=3, max_value=9), min_size=0, max_size=12),
        max_new=st.integers(min_value=1, max_value=16),
        stop_at=st.one_of(st.none(), st.integers(min_value=0, max_value=15)),
        namespace=st.sampled_from([None, None, "tenant"]),
        by_prompt=st.booleans(),
        scores_prompt=st.sampled_from([False, False, True]),
        priority=st.sampled_from([0, 0, 0, -1, 3]),
    )
    def add(
        self,
        stem: int,
        stem_len: int,
        suffix: list[int],
        max_new: int,
        stop_at: int | None,
        namespace: str | None,
        by_prompt: bool,
        scores_prompt: bool,
        priority: int,
    ) -> None:
        prompt = (STEMS[stem][:stem_len] if stem >= 0 else []) + suffix
        if not prompt:
            prompt = [5]
        request = Request(id=self.next_id, prompt=prompt, params=SamplingParams(
            max_new_tokens=max_new, stop_token_ids=[STOP],
            prompt_logprobs=0 if scores_prompt else None, priority=priority,
        ), namespace=namespace)
        self.next_id += 1
        if stop_at is not None:
            self.model.stop_at[request.id] = stop_at
        if by_prompt:
            self.model.by_prompt.add(request.id)
        needed = -(-(len(prompt) + max_new - 1) // self.page_size)
        if needed > self.num_pages:
            try:
                self.sched.add(request)
            except ValueError as exc:
                assert "pages" in str(exc)
                return
            raise AssertionError("a request larger than the pool was accepted")
        self.sched.add(request)
        self.requests.append(request)
        self.work_tokens += len(prompt) + max_new

    @precondition(lambda self: self.sched.has_work)
    @rule()
    def step(self) -> None:
        batch = self.sched.schedule()
        assert batch is not None, "work left but nothing scheduled"
        assert batch.num_tokens <= self.sched.config.max_batch_tokens
        assert len(batch.entries) <= self.sched.config.max_running
        self.sched.commit(batch, self.model.step(batch))
        self.sched.observe_step(batch, 0.01 + 0.001 * batch.num_tokens)

    @precondition(lambda self: self.sched.has_work)
    @rule(pick=st.integers(min_value=0, max_value=10_000), then_step=st.booleans())
    def abort(self, pick: int, then_step: bool) -> None:
        live = [r for r in self.requests if not r.is_done]
        if not live:
            return
        victim = live[pick % len(live)]
        if then_step:
            # Abort between schedule() and commit(): the batch is still committed.
            batch = self.sched.schedule()
            if batch is None:
                return
            tokens = self.model.step(batch)
            assert self.sched.abort(victim.id) is victim
            self.sched.commit(batch, tokens)
        else:
            assert self.sched.abort(victim.id) is victim
        assert victim.state is RequestState.ABORTED and victim.finish_reason == "abort"
        assert victim.kv is None
        assert self.sched.abort(victim.id) is None

    @invariant()
    def pages_owned_once(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    @invariant()
    def outputs_follow_script(self) -> None:
        for request in getattr(self, "requests", []):
            assert_output_follows_script(self.model, request)
            assert len(request.output) <= request.max_new_tokens

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        # Each step computes at least one token of the oldest running request; preemption
        # can redo a request's work, at most once per younger request's admission.
        bound = 4 * self.work_tokens * (len(self.requests) + 1) + 10
        run_to_idle(self.sched, self.model, max_steps=bound)
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0
        self.sched.check_integrity()
        assert self.allocator.num_free + self.cache.cached_pages == self.allocator.num_pages
        for request in self.requests:
            assert request.is_done, f"request {request.id} neither finished nor aborted"
            assert request.kv is None
            assert_output_follows_script(self.model, request)
            scored = self.model.scored.get(request.id, [])
            if request.params.prompt_logprobs is None:
                assert not scored
            else:  # every prompt position scored once, in order; none from the cache
                assert request.cached_tokens == 0
                if request.state is RequestState.FINISHED:
                    assert scored == list(range(len(request.prompt) - 1))
            if request.state is RequestState.FINISHED:
                if request.finish_reason == "stop":
                    assert request.output[-1] == STOP
                else:
                    assert request.finish_reason == "length"
                    assert len(request.output) == request.max_new_tokens
        counters = self.sched.counters
        assert counters.finished + counters.aborted == len(self.requests)
        event("preempted" if counters.preemptions else "no preemption")
        event("evicted" if counters.evicted_pages else "no eviction")
        event("grouped" if counters.grouped_deferrals else "no grouping")
        event("hit" if counters.cached_tokens else "no hit")


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
TestSchedulerStateMachine = SchedulerMachine.TestCase
