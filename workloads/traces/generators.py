"""Trace generators: the shapes of traffic that prefix caching is for (and one it cannot help).

Every generator is a pure function of (tokenizer, params, seed): the same inputs give the same
trace. Sizes are in tokens of the real tokenizer. Defaults finish on a 2-core CPU (~100-300
prefill tokens/s for the bundled 135M model) in a few minutes per workload and configuration;
shared-prefix keeps the issue's headline shape (8 x 8 prompts, 1,000-token prefixes), which
takes longer with the cache off.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from workloads.traces.corpus import Entry
from workloads.traces.text import TextSource
from workloads.traces.tokenizer import TextTokenizer
from workloads.traces.trace import Session, Trace, Turn

QUESTION_FORMS = (
    "What does {name} do, and when would I use it?",
    "Can you explain {name} in plain words?",
    "How do I use {name} correctly? Give a short example.",
    "What are the pitfalls of {name}?",
    "Summarise the behaviour of {name} in two sentences.",
    "Why would someone choose {name} over the alternatives?",
)

CHAT_PERSONA = (
    "You are a patient assistant for Python programmers. Answer in a few clear sentences, "
    "name the functions you rely on, and say so when you are unsure. The notes below are "
    "excerpts of the standard library's documentation; use them when they help.\n\nNotes:\n"
)
RAG_INSTRUCTIONS = (
    "You answer questions about the Python standard library using only the document provided "
    "below. Quote the relevant function names. If the document does not contain the answer, "
    "say that it does not."
)
AGENT_PREAMBLE = (
    "You are an autonomous coding agent. Solve the task step by step. At each step write one "
    "line starting with 'Thought:' and one line 'Action: tool_name(arguments)'. After each "
    "action you receive an observation. The tools you can call are documented below.\n\nTools:\n"
)
FEWSHOT_PREAMBLE = (
    "Answer each question about the Python standard library with one sentence.\n\n"
)


class ChatParams(msgspec.Struct, frozen=True):
    """N users x T turns over one shared system prompt, closed loop."""

    users: int = 8
    turns: int = 4
    system_tokens: int = 384
    user_tokens: int = 48
    max_new_tokens: int = 48
    think_s: float = 0.0
    arrival_rate: float = 0.0  # new sessions per second (Poisson); 0: all start at once


class RagParams(msgspec.Struct, frozen=True):
    """Requests = instructions + retrieved document(s) + question; documents Zipf-popular."""

    documents: int = 12
    requests: int = 32
    doc_tokens: int = 512
    docs_per_request: int = 1
    zipf_s: float = 1.1
    question_tokens: int = 48
    max_new_tokens: int = 32
    arrival_rate: float = 0.0


class AgentParams(msgspec.Struct, frozen=True):
    """Tasks as trajectories over a long tool-description prompt, with branching steps."""

    tasks: int = 3
    steps: int = 4
    tool_tokens: int = 768
    task_tokens: int = 64
    observation_tokens: int = 64
    max_new_tokens: int = 32
    branch_every: int = 2  # every k-th step forks candidates (0: never)
    branch_factor: int = 2  # candidates per fork, besides the step itself
    arrival_rate: float = 0.0


class FewshotParams(msgspec.Struct, frozen=True):
    """One long few-shot preamble, many short questions."""

    examples: int = 24
    requests: int = 24
    max_new_tokens: int = 32
    arrival_rate: float = 0.0


class SharedPrefixParams(msgspec.Struct, frozen=True):
    """G groups x P prompts: a group prefix + a question (SGLang's generated-shared-prefix)."""

    groups: int = 8
    prompts_per_group: int = 8
    prefix_tokens: int = 1000
    question_tokens: int = 60
    max_new_tokens: int = 32
    arrival_rate: float = 0.0


class UniqueParams(msgspec.Struct, frozen=True):
    """Prompts that share nothing: the cache can only cost here."""

    requests: int = 16
    prompt_tokens: int = 512
    max_new_tokens: int = 32
    arrival_rate: float = 0.0


def _positive(params: msgspec.Struct, *, allow_zero: tuple[str, ...] = ()) -> None:
    for name in params.__struct_fields__:
        value = getattr(params, name)
        low = 0 if name in allow_zero or isinstance(value, float) else 1
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def _arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """Poisson arrival times at ``rate`` per second; all zero when rate is 0."""
    if rate <= 0:
        return [0.0] * count
    t = 0.0
    out = []
    for _ in range(count):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def _question(source: TextSource, entry: Entry, rng: random.Random, num_tokens: int) -> str:
    """A user question about ``entry``, padded with pasted documentation to ``num_tokens``."""
    ask = rng.choice(QUESTION_FORMS).format(name=entry.name)
    context = " ".join(entry.paragraphs) or entry.summary
    filler = source.paragraphs_text(num_tokens, rng)
    return source.fit(f"{ask} The docs say: {context}\n{filler}", num_tokens)


def chat(tokenizer: TextTokenizer, params: ChatParams, seed: int,
         source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("think_s", "arrival_rate"))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    system = source.fit(CHAT_PERSONA + source.paragraphs_text(params.system_tokens, rng),
                        params.system_tokens)
    starts = _arrivals(rng, params.users, params.arrival_rate)
    sessions = []
    for user in range(params.users):
        turns = tuple(
            Turn(
                user=_question(source, rng.choice(source.corpus.documented), rng,
                               params.user_tokens),
                max_new_tokens=params.max_new_tokens,
                think_s=params.think_s if k else 0.0,
            )
            for k in range(params.turns)
        )
        sessions.append(Session(f"user{user}", turns, system=system, arrival_s=starts[user]))
    return Trace("chat", seed, msgspec.to_builtins(params), {}, tuple(sessions))


def _turns(source: TextSource, rng: random.Random, count: int, user_tokens: int,
           max_new_tokens: int) -> tuple[Turn, ...]:
    """``count`` turns, each a question about a documented name."""
    return tuple(
        Turn(
            user=_question(source, rng.choice(source.corpus.documented), rng, user_tokens),
            max_new_tokens=max_new_tokens,
        )
        for _ in range(count)
    )


class SessionsParams(msgspec.Struct, frozen=True):
    """Chat sessions that come back: each user has a long context of their own (a persona
    and notes), and between two of a user's turns every other user takes one, so with a
    small KV pool a session returns to find its history pushed out (what KV tiers are for)."""

    users: int = 16
    turns: int = 3
    context_tokens: int = 384
    user_tokens: int = 32
    max_new_tokens: int = 16


def sessions(tokenizer: TextTokenizer, params: SessionsParams, seed: int,
             source: TextSource | None = None) -> Trace:
    _positive(params)
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    out = []
    for user in range(params.users):
        context = source.fit(CHAT_PERSONA + source.paragraphs_text(params.context_tokens, rng),
                             params.context_tokens)
        turns = _turns(source, rng, params.turns, params.user_tokens, params.max_new_tokens)
        out.append(Session(f"user{user}", turns, system=context))
    return Trace("sessions", seed, msgspec.to_builtins(params), {}, tuple(out))


class TenantsParams(msgspec.Struct, frozen=True):
    """Multi-tenant chat: many system prompts (one per tenant, tenants Zipf-popular), each
    session a user of one tenant, sessions arriving as a Poisson process. What a router in
    front of replicas must keep apart: a tenant's prompt is worth caching on one replica."""

    tenants: int = 12
    sessions: int = 48
    turns: int = 2
    system_tokens: int = 320
    user_tokens: int = 32
    max_new_tokens: int = 16
    zipf_s: float = 0.8
    arrival_rate: float = 2.0  # new sessions per second; 0: all at once


def tenants(tokenizer: TextTokenizer, params: TenantsParams, seed: int,
            source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("zipf_s", "arrival_rate"))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    systems = [
        source.fit(f"Tenant {t}. " + CHAT_PERSONA
                   + source.paragraphs_text(params.system_tokens, rng), params.system_tokens)
        for t in range(params.tenants)
    ]
    weights = zipf_weights(params.tenants, params.zipf_s)
    starts = _arrivals(rng, params.sessions, params.arrival_rate)
    out = []
    for user in range(params.sessions):
        tenant = rng.choices(range(params.tenants), weights)[0]
        turns = _turns(source, rng, params.turns, params.user_tokens, params.max_new_tokens)
        out.append(Session(f"tenant{tenant}-user{user}", turns, system=systems[tenant],
                           arrival_s=starts[user]))
    return Trace("tenants", seed, msgspec.to_builtins(params), {}, tuple(out))


def zipf_weights(count: int, s: float) -> list[float]:
    """Normalised Zipf weights 1/r^s for ranks 1..count."""
    raw = [1.0 / (r**s) for r in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def rag(tokenizer: TextTokenizer, params: RagParams, seed: int,
        source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("arrival_rate",))
    if params.docs_per_request > params.documents:
        raise ValueError(
            f"docs_per_request must be <= documents ({params.documents}), "
            f"got {params.docs_per_request}"
        )
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    corpus = source.corpus
    # Modules with enough text for a whole document, in corpus order, then a seeded pick.
    candidates = [m for m in corpus.by_module
                  if source.count(corpus.module_document(m)) >= params.doc_tokens]
    if len(candidates) < params.documents:
        raise ValueError(
            f"documents must be <= {len(candidates)} at doc_tokens={params.doc_tokens}, "
            f"got {params.documents}"
        )
    modules = rng.sample(candidates, params.documents)  # popularity rank order
    documents = {f"doc-{m}": source.fit(corpus.module_document(m), params.doc_tokens)
                 for m in modules}
    doc_ids = list(documents)
    weights = zipf_weights(params.documents, params.zipf_s)
    starts = _arrivals(rng, params.requests, params.arrival_rate)
    sessions = []
    for i in range(params.requests):
        picked: list[int] = []
        while len(picked) < params.docs_per_request:
            rank = rng.choices(range(params.documents), weights)[0]
            if rank not in picked:
                picked.append(rank)
        entries = [e for e in corpus.by_module[modules[picked[0]]] if e.qualname]
        entry = rng.choice(entries) if entries else corpus.by_module[modules[picked[0]]][0]
        question = _question(source, entry, rng, params.question_tokens)
        sessions.append(Session(
            f"q{i}", (Turn(question, params.max_new_tokens),), system=RAG_INSTRUCTIONS,
            documents=tuple(doc_ids[r] for r in picked), arrival_s=starts[i],
        ))
    return Trace("rag", seed, msgspec.to_builtins(params), documents, tuple(sessions))


def _tool_descriptions(source: TextSource, rng: random.Random, num_tokens: int) -> str:
    entries = list(source.corpus.documented)
    rng.shuffle(entries)
    parts = []
    size = 0
    for entry in entries:
        body = " ".join(entry.paragraphs[:1]) or entry.summary
        text = f"- {entry.name}: {body}"
        parts.append(text)
        size += source.count(text) + 1
        if size >= num_tokens:
            break
    return "\n".join(parts)


def agent(tokenizer: TextTokenizer, params: AgentParams, seed: int,
          source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("branch_every", "branch_factor", "arrival_rate"))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    system = source.fit(AGENT_PREAMBLE + _tool_descriptions(source, rng, params.tool_tokens),
                        params.tool_tokens)
    starts = _arrivals(rng, params.tasks, params.arrival_rate)
    documented = source.corpus.documented
    sessions = []
    for task in range(params.tasks):
        goal = rng.choice(documented)
        turns = [Turn(source.fit(
            f"Task: write a small script that uses {goal.name} and explain the result. "
            f"Background: {source.paragraphs_text(params.task_tokens, rng)}",
            params.task_tokens), params.max_new_tokens)]
        for step in range(1, params.steps):
            observation = source.fit(
                "Observation: " + source.paragraphs_text(params.observation_tokens, rng),
                params.observation_tokens)
            branches: tuple[str, ...] = ()
            if params.branch_every and step % params.branch_every == 0:
                tools = rng.sample(documented, params.branch_factor)
                branches = tuple(f"Thought: I could try {t.name} next.\nAction: {t.name}("
                                 for t in tools)
            turns.append(Turn(observation, params.max_new_tokens, branches=branches))
        sessions.append(Session(f"task{task}", tuple(turns), system=system,
                                arrival_s=starts[task]))
    return Trace("agent", seed, msgspec.to_builtins(params), {}, tuple(sessions))


def fewshot(tokenizer: TextTokenizer, params: FewshotParams, seed: int,
            source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("arrival_rate",))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    documented = list(source.corpus.documented)
    if params.examples + params.requests > len(documented):
        raise ValueError(
            f"examples + requests must be <= {len(documented)}, "
            f"got {params.examples + params.requests}"
        )
    picked = rng.sample(documented, params.examples + params.requests)
    shots = picked[: params.examples]
    preamble = FEWSHOT_PREAMBLE + "".join(
        f"Q: What does {e.name} do?\nA: {e.summary}\n\n" for e in shots
    )
    starts = _arrivals(rng, params.requests, params.arrival_rate)
    sessions = tuple(
        Session(f"q{i}", (Turn(f"Q: What does {e.name} do?\nA:", params.max_new_tokens),),
                system=preamble, template="raw", arrival_s=starts[i])
        for i, e in enumerate(picked[params.examples:])
    )
    return Trace("fewshot", seed, msgspec.to_builtins(params), {}, sessions)


def shared_prefix(tokenizer: TextTokenizer, params: SharedPrefixParams, seed: int,
                  source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("arrival_rate",))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    count = params.groups * params.prompts_per_group
    sizes = [params.prefix_tokens] * params.groups + [params.question_tokens] * count
    texts = source.windows(sizes, rng, "groups x (prefix_tokens + prompts x question_tokens)")
    prefixes, questions = texts[: params.groups], texts[params.groups:]
    starts = _arrivals(rng, count, params.arrival_rate)
    order = list(range(count))
    rng.shuffle(order)  # groups interleave in arrival order, as independent users would
    sessions = []
    for position, i in enumerate(order):
        group = i // params.prompts_per_group
        sessions.append(Session(
            f"g{group}p{i % params.prompts_per_group}",
            (Turn(questions[i], params.max_new_tokens, ignore_eos=True),),
            system=prefixes[group], template="raw", arrival_s=starts[position],
        ))
    return Trace("shared-prefix", seed, msgspec.to_builtins(params), {}, tuple(sessions))


def unique(tokenizer: TextTokenizer, params: UniqueParams, seed: int,
           source: TextSource | None = None) -> Trace:
    _positive(params, allow_zero=("arrival_rate",))
    source = source or TextSource(tokenizer)
    rng = random.Random(seed)
    texts = source.windows([params.prompt_tokens] * params.requests, rng,
                           "requests x prompt_tokens")
    starts = _arrivals(rng, params.requests, params.arrival_rate)
    sessions = tuple(
        Session(f"u{i}", (Turn(text, params.max_new_tokens, ignore_eos=True),),
                template="raw", arrival_s=starts[i])
        for i, text in enumerate(texts)
    )
    return Trace("unique", seed, msgspec.to_builtins(params), {}, sessions)


Generator = Callable[..., Trace]

WORKLOADS: dict[str, tuple[type[msgspec.Struct], Generator]] = {
    "chat": (ChatParams, chat),
    "rag": (RagParams, rag),
    "agent": (AgentParams, agent),
    "fewshot": (FewshotParams, fewshot),
    "shared-prefix": (SharedPrefixParams, shared_prefix),
    "unique": (UniqueParams, unique),
    "sessions": (SessionsParams, sessions),
    "tenants": (TenantsParams, tenants),
}


def make_params(workload: str, overrides: dict[str, Any] | None = None) -> msgspec.Struct:
    """The params struct of ``workload`` with ``overrides`` applied (unknown names raise)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    cls = WORKLOADS[workload][0]
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(cls.__struct_fields__))
    if unknown:
        raise ValueError(
            f"{workload}: unknown parameter(s) {unknown}; known: {list(cls.__struct_fields__)}"
        )
    try:
        return msgspec.convert(overrides, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{workload}: {exc}") from exc


def generate(workload: str, tokenizer: TextTokenizer, seed: int = 0,
             overrides: dict[str, Any] | None = None,
             source: TextSource | None = None) -> Trace:
    """Build the trace of ``workload`` (see :data:`WORKLOADS`) for ``seed``."""
    params = make_params(workload, overrides)
    return WORKLOADS[workload][1](tokenizer, params, seed, source)

