from __future__ import annotations

from collections import Counter

import pytest

from workloads.traces.generators import WORKLOADS, generate, make_params, zipf_weights
from workloads.traces.ideal import ideal_cached_tokens
from workloads.traces.prompts import SessionPrompts
from workloads.traces.text import encode, fit_tokens


def _first_prompts(trace, tokenizer):
    out = []
    for session in trace.sessions:
        prompts = SessionPrompts(session, trace, tokenizer)
        prompt = prompts.prompt()
        out.append(prompt)
        out.extend(prompts.branch_prompts(prompt))
    return out


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_same_seed_gives_the_same_trace(workload, tokenizer, source):
    assert generate(workload, tokenizer, 7, source=source) == generate(
        workload, tokenizer, 7, source=source
    )


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_another_seed_gives_another_trace(workload, tokenizer, source):
    assert generate(workload, tokenizer, 7, source=source) != generate(
        workload, tokenizer, 8, source=source
    )


def test_shared_prefix_prompts_have_the_requested_token_lengths(tokenizer, source):
    trace = generate("shared-prefix", tokenizer, 0, source=source, overrides={
        "groups": 3, "prompts_per_group": 4, "prefix_tokens": 200, "question_tokens": 30})
    prompts = _first_prompts(trace, tokenizer)
    assert len(prompts) == 12
    assert {len(p) for p in prompts} == {230}
    assert len({tuple(p[:200]) for p in prompts}) == 3
    assert len({tuple(p[200:]) for p in prompts}) == 12


def test_unique_prompts_share_no_page(tokenizer, source):
    trace = generate("unique", tokenizer, 0, source=source,
                     overrides={"requests": 10, "prompt_tokens": 128})
    prompts = _first_prompts(trace, tokenizer)
    assert {len(p) for p in prompts} == {128}
    assert ideal_cached_tokens([(p, []) for p in prompts], page_size=16) == [0] * 10


def test_chat_users_share_the_system_prompt_but_not_their_questions(tokenizer, source):
    trace = generate("chat", tokenizer, 0, source=source, overrides={"users": 3, "turns": 2})
    assert len({s.system for s in trace.sessions}) == 1
    assert len({t.user for s in trace.sessions for t in s.turns}) == 6
    prompts = _first_prompts(trace, tokenizer)
    cached = ideal_cached_tokens([(p, []) for p in prompts], page_size=16)
    system_tokens = trace.params["system_tokens"]
    assert cached[0] == 0 and all(c >= system_tokens - 16 for c in cached[1:])


def test_chat_next_turn_carries_the_previous_reply(tokenizer, source):
    trace = generate("chat", tokenizer, 0, source=source, overrides={"users": 1, "turns": 2})
    prompts = SessionPrompts(trace.sessions[0], trace, tokenizer)
    first = prompts.prompt()
    reply = encode(tokenizer, "The answer is forty-two.") + [tokenizer.eos_token_id]
    prompts.record_reply(first, reply, "The answer is forty-two.")
    second = prompts.prompt()
    assert second[: len(first) + len(reply)] == first + reply  # the reply's own tokens, reused
    assert trace.sessions[0].turns[1].user in tokenizer.decode(second[len(first) + len(reply):])


def test_rag_popularity_follows_zipf(tokenizer, source):
    trace = generate("rag", tokenizer, 0, source=source,
                     overrides={"documents": 6, "requests": 300, "doc_tokens": 100,
                                "question_tokens": 16})
    counts = Counter(s.documents[0] for s in trace.sessions)
    ranked = [counts[d] for d in trace.documents]  # documents are stored in rank order
    assert ranked[0] == max(ranked)
    assert ranked[0] > 2 * ranked[-1]
    assert abs(ranked[0] / 300 - zipf_weights(6, 1.1)[0]) < 0.08


def test_agent_branches_fork_from_the_step_prompt(tokenizer, source):
    trace = generate("agent", tokenizer, 0, source=source,
                     overrides={"tasks": 1, "steps": 3, "branch_every": 2, "branch_factor": 2})
    turns = trace.sessions[0].turns
    assert [len(t.branches) for t in turns] == [0, 0, 2]
    prompts = SessionPrompts(trace.sessions[0], trace, tokenizer)
    for _ in range(2):
        prompts.record_reply(prompts.prompt(), encode(tokenizer, "Thought: ok"))
    step = prompts.prompt()
    for branch in prompts.branch_prompts(step):
        assert branch[: len(step)] == step and len(branch) > len(step)


def test_fewshot_requests_share_the_preamble(tokenizer, source):
    trace = generate("fewshot", tokenizer, 0, source=source,
                     overrides={"examples": 8, "requests": 5})
    prompts = _first_prompts(trace, tokenizer)
    preamble = encode(tokenizer, trace.sessions[0].system)
    assert all(p[: len(preamble)] == preamble for p in prompts)


def test_unknown_or_bad_parameters_raise(tokenizer, source):
    with pytest.raises(ValueError, match="unknown parameter"):
        make_params("chat", {"userz": 3})
    with pytest.raises(ValueError, match="users"):
        generate("chat", tokenizer, 0, source=source, overrides={"users": 0})
    with pytest.raises(ValueError, match="workload"):
        make_params("nope")
    with pytest.raises(ValueError, match="docs_per_request"):
        generate("rag", tokenizer, 0, source=source,
                 overrides={"documents": 2, "docs_per_request": 3})


def test_fit_tokens_cuts_to_the_exact_size(tokenizer, source):
    text = source.corpus.text()[:5000]
    for n in (1, 17, 100, 333):
        assert len(encode(tokenizer, fit_tokens(tokenizer, text, n))) == n


def test_sessions_give_every_user_a_context_of_their_own(tokenizer, source):
    trace = generate("sessions", tokenizer, 0, source=source, overrides={
        "users": 5, "turns": 2, "context_tokens": 120})
    assert len(trace.sessions) == 5
    assert all(len(s.turns) == 2 for s in trace.sessions)
    contexts = [s.system for s in trace.sessions]
    assert len(set(contexts)) == 5, "two users share a context: nothing would be pushed out"
    assert all(len(encode(tokenizer, c)) <= 120 for c in contexts)


def test_tenants_share_a_system_prompt_per_tenant_and_arrive_over_time(tokenizer, source):
    trace = generate("tenants", tokenizer, 0, source=source, overrides={
        "tenants": 4, "sessions": 30, "system_tokens": 100, "arrival_rate": 5.0})
    assert len(trace.sessions) == 30
    systems = {s.system for s in trace.sessions}
    assert 1 < len(systems) <= 4  # popular tenants repeat, no more prompts than tenants
    by_tenant = {s.id.split("-")[0]: s.system for s in trace.sessions}
    assert len(set(by_tenant.values())) == len(by_tenant)  # one prompt per tenant
    arrivals = [s.arrival_s for s in trace.sessions]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
