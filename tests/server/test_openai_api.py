"""The server through the official ``openai`` client (sync, async, streaming): what an
application pointed at ``radixkv serve`` sees. One server process serves the whole session;
tests that look at the cache use their own ``cache_salt`` so they start cold."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
]


# Long enough that prompts share whole pages (16 tokens) and n choices group (>= 32 tokens).
SYSTEM = (
    "You are a helpful assistant. Answer briefly and precisely, in plain English, and say so "
    "when you do not know the answer."
)


def ask(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]


def salt() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def local(loaded_fp32: Any) -> Any:
    """An in-process engine on the same model and dtype: the reference for HTTP answers."""
    with Engine(model=loaded_fp32, num_pages=256) as eng:
        yield eng


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_chat_over_http_equals_engine_generate(client: openai.OpenAI, local: Engine) -> None:
    for question in QUESTIONS[:2]:
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(question), max_tokens=24, temperature=0
        )
        [expected] = local.generate(ask(question), SamplingParams(max_new_tokens=24, temperature=0))
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason == (
            "length" if expected.finish_reason == "length" else "stop"
        )
        assert reply.usage.prompt_tokens == expected.prompt_tokens
        assert reply.usage.completion_tokens == len(expected.token_ids)


def test_greedy_completion_over_http_equals_engine_generate(
    client: openai.OpenAI, local: Engine
) -> None:
    prompt = "The three primary colours are"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    [expected] = local.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))
    assert reply.choices[0].text == expected.text
    by_ids = client.completions.create(
        model=MODEL, prompt=local.encode(prompt), max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == expected.text


def test_streamed_chat_deltas_join_to_the_whole_reply_and_usage_comes_last(
    client: openai.OpenAI,
) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=ask(QUESTIONS[2]), max_tokens=20, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask(QUESTIONS[2]),
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_second_request_sharing_a_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    tenant = salt()
    first = client.chat.completions.create(
        model=MODEL,
        messages=ask(QUESTIONS[0]),
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": tenant},
    )
    second = client.chat.completions.create(
        model=MODEL,
        messages=ask(QUESTIONS[1]),
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": tenant},
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The system prompt and the template's first tokens: whole pages of 16.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_different_cache_salts_never_share_a_page(client: openai.OpenAI) -> None:
    a, b = salt(), salt()

    def cached(tenant: str | None) -> int:
        body = {} if tenant is None else {"cache_salt": tenant}
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ask(QUESTIONS[3]),
            max_tokens=2,
            temperature=0,
            extra_body=body,
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # the same prompt, another tenant: nothing shared
    assert cached(a) > 0  # its own tenant hits


def test_n_choices_compute_the_prompt_once_and_seeded_choices_differ(
    client: openai.OpenAI, server_url: str
) -> None:
    tenant = salt()
    computed_before = metric(server_url, "radixkv:prefill_computed_tokens_total")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask(QUESTIONS[3]),
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=4,
        extra_body={"cache_salt": tenant},
    )
    computed = metric(server_url, "radixkv:prefill_computed_tokens_total") - computed_before
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in reply.choices}) > 1
    prompt = reply.usage.prompt_tokens
    # One full prefill plus, per extra choice, at most the last partial page.
    assert computed <= prompt + 3 * 16
    again = client.chat.completions.create(
        model=MODEL,
        messages=ask(QUESTIONS[3]),
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=4,
        extra_body={"cache_salt": tenant},
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_chat_logprobs_are_the_models_and_greedy_picks_the_best(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask(QUESTIONS[0]),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    text = "".join(e.token for e in content)
    assert text.startswith(reply.choices[0].message.content)


def test_completion_logprobs_and_stop_strings(client: openai.OpenAI, local: Engine) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="One, two, three, four,",
        max_tokens=16,
        temperature=0,
        logprobs=2,
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.text_offset[0] == 0
    stopped = client.completions.create(
        model=MODEL,
        prompt="One, two, three, four,",
        max_tokens=16,
        temperature=0,
        stop=[" six"],
    )
    assert " six" not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=MODEL, prompt="One, two, three, four,", max_tokens=16, temperature=0,
        stop=[" six"], extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == stopped.choices[0].text + " six"
    tail = client.completions.create(
        model=MODEL, prompt="One, two, three, four,", max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert tail.usage.prompt_tokens == 3
    echoed = client.completions.create(
        model=MODEL, prompt="One, two, three, four,", max_tokens=2, temperature=0, logprobs=1,
        echo=True, extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
    ).choices[0]
    kept = local.tokenizer.encode("One, two, three, four,")[-3:]
    assert echoed.model_extra["prompt_token_ids"] == kept
    assert echoed.text.startswith(local.tokenizer.decode(kept))
    assert echoed.text == "".join(echoed.logprobs.tokens)
    assert len(echoed.logprobs.tokens) == 3 + 2
    assert reply.choices[0].text.startswith(stopped.choices[0].text)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_asks(
    client: openai.OpenAI, local: Engine
) -> None:
    """lm-evaluation-harness's ``local-completions`` loglikelihood request: token ids, echo,
    logprobs=1, max_tokens=1. Each prompt token gets the log-probability its generation
    would have had (the same floats), the first null; is_greedy reads top_logprobs."""
    context = local.tokenizer.encode("Question: What colour is the sky?\nAnswer:")
    made = client.completions.create(
        model=MODEL, prompt=[context], max_tokens=4, temperature=0, logprobs=1
    ).choices[0].logprobs
    continuation = local.tokenizer.encode("".join(made.tokens))
    assert len(continuation) == 4
    ids = context + continuation
    reply = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234,
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(context) : len(ids)] == made.token_logprobs
    greedy_steps = zip(lp.token_logprobs[len(context) : -1], lp.top_logprobs[len(context) : -1])
    assert all(tok == max(top.values()) for tok, top in greedy_steps)  # harness's is_greedy
    assert reply.choices[0].text.startswith(local.tokenizer.decode(ids))
    assert lp.text_offset == sorted(lp.text_offset)
    only = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, logprobs=1, echo=True)
    choice = only.choices[0]
    assert choice.logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert choice.finish_reason == "length" and only.usage.completion_tokens == 0
    assert choice.text == local.tokenizer.decode(ids)


def test_streamed_echo_with_logprobs_joins_to_the_whole_reply(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="The three primary colours are", max_tokens=6,
                temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text == "The three primary colours are"
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [x for c in chunks if c.logprobs for x in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_n_choices_of_an_echoed_scored_prompt_compute_it_once(
    client: openai.OpenAI, server_url: str
) -> None:
    """A prompt's scores are the same for every choice: its first choice computes them and
    each choice shows them, whole or streamed (n=16 on 501 tokens took 16 scored prefills)."""
    prompt = "Count these words: " + " ".join(f"w{i}" for i in range(60))  # nothing cached
    args = dict(model=MODEL, prompt=prompt, n=4, max_tokens=2, temperature=0, logprobs=1,
                echo=True)
    before = metric(server_url, "radixkv:prefill_computed_tokens_total")
    reply = client.completions.create(**args)
    computed = metric(server_url, "radixkv:prefill_computed_tokens_total") - before
    size = reply.usage.prompt_tokens
    assert computed < 2 * size  # one scored prefill, then the cached prompt's last page
    echoed = [c.logprobs.token_logprobs[:size] for c in reply.choices]
    assert echoed[0][0] is None and len(echoed[0]) == size and echoed.count(echoed[0]) == 4
    firsts: dict[int, Any] = {}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == [0, 1, 2, 3]
    for c in firsts.values():
        assert c.text == prompt and c.logprobs.token_logprobs == echoed[0]


def test_vllm_prompt_logprobs_on_both_endpoints(client: openai.OpenAI, local: Engine) -> None:
    prompt = "Hello there, how are you"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    ).model_dump()
    scores = reply["choices"][0]["prompt_logprobs"]
    ids = local.tokenizer.encode(prompt)
    [expected] = local.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    assert scores[0] is None and len(scores) == len(ids)
    for position, entry, token in zip(scores[1:], expected.prompt_logprobs[1:], ids[1:]):
        assert position[str(token)]["logprob"] == entry.logprob
        assert position[str(token)]["rank"] == entry.rank
        assert {int(k) for k in position} == {token, *(t for t, _ in entry.top)}
    chat = client.chat.completions.create(
        model=MODEL, messages=ask(QUESTIONS[0]), max_tokens=2, extra_body={"prompt_logprobs": 0}
    ).model_dump()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_batch_of_prompts_returns_choices_in_order(client: openai.OpenAI, local: Engine) -> None:
    prompts = ["Once upon a time", "The ocean is"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    expected = local.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [
        expected[0].text,
        expected[0].text,
        expected[1].text,
        expected[1].text,
    ]
    assert reply.usage.prompt_tokens == sum(o.prompt_tokens for o in expected)


def test_tokenize_and_detokenize_round_trip(server_url: str, local: Engine) -> None:
    text = "Prefix caching reuses KV pages."
    tokens = httpx.post(server_url + "/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == local.encode(text) and tokens["count"] == len(tokens["tokens"])
    back = httpx.post(server_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(server_url + "/tokenize", json={"messages": ask("hi")}).json()
    assert chat["tokens"] == local.encode(ask("hi"))


def test_metrics_count_cache_queries_and_hits_as_usage_reports_them(
    client: openai.OpenAI, server_url: str
) -> None:
    tenant = salt()
    before = {
        n: metric(server_url, n)
        for n in (
            "radixkv:prefix_cache_queries_total",
            "radixkv:prefix_cache_hits_total",
            "radixkv:generation_tokens_total",
        )
    }
    usages = []
    for question in QUESTIONS[:2]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ask(question),
            max_tokens=3,
            temperature=0,
            extra_body={"cache_salt": tenant, "ignore_eos": True},
        )
        usages.append(reply.usage)
    delta = {n: metric(server_url, n) - v for n, v in before.items()}
    assert delta["radixkv:prefix_cache_queries_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["radixkv:prefix_cache_hits_total"] == sum(
        u.prompt_tokens_details.cached_tokens for u in usages
    )
    assert delta["radixkv:generation_tokens_total"] == 6
    text = httpx.get(server_url + "/metrics").text
    for name in (
        "radixkv:time_to_first_token_seconds",
        "radixkv:inter_token_latency_seconds",
        "radixkv:e2e_request_latency_seconds",
        "radixkv:request_queue_time_seconds",
        "radixkv:num_requests_running",
        "radixkv:kv_pages_free",
        "radixkv:request_success_total",
        "radixkv:num_preemptions_total",
    ):
        assert name in text
    assert httpx.get(server_url + "/health").status_code == 200


def test_32_concurrent_streaming_clients_all_get_their_own_answer(
    server_url: str, local: Engine
) -> None:
    expected = {
        q: local.generate(ask(q), SamplingParams(max_new_tokens=12, temperature=0))[0].text
        for q in QUESTIONS
    }
    client = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)

    async def one(question: str) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=ask(question), max_tokens=12, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return question, "".join(parts)

    async def run() -> list[tuple[str, str]]:
        async with client:
            return await asyncio.gather(*(one(QUESTIONS[i % 4]) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for question, text in results:
        assert text == expected[question]
    assert metric(server_url, "radixkv:kv_pages_in_use") == 0


def test_readme_server_example_runs_against_the_server(server_url: str, capsys) -> None:
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parents[2] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    [block] = [b for b in blocks if "openai.OpenAI" in b]
    code = block.replace("http://127.0.0.1:8000", server_url)
    exec(compile(code, str(readme), "exec"), {"__name__": "readme_server_example"})
    assert capsys.readouterr().out.strip()


def test_penalties_and_logit_bias_over_http_equal_the_engines(
    client: openai.OpenAI, local: Engine
) -> None:
    """Through the openai client: logit_bias -100 bans the token greedy decoding would pick,
    and penalised greedy replies are the engine's own."""
    messages = ask(QUESTIONS[1])
    [plain] = local.generate(messages, SamplingParams(max_new_tokens=16, temperature=0))
    first = plain.token_ids[0]
    banned = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0,
        logit_bias={str(first): -100}, extra_body={"return_token_ids": True},
    )
    ids = banned.choices[0].model_extra["token_ids"]
    assert first not in ids
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, **penalties,
        extra_body={"repetition_penalty": 1.2},
    )
    [expected] = local.generate(
        messages,
        SamplingParams(max_new_tokens=16, temperature=0, repetition_penalty=1.2, **penalties),
    )
    assert reply.choices[0].message.content == expected.text != plain.text
