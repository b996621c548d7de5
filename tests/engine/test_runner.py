"""ModelRunner.step: greedy equals transformers' generate; seeded sampling ignores the batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model.bringup.platforms import platform_for
from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request

PAGE = 16
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain what a radix tree is in one sentence.",
    "How many legs does a spider have?",
]


def new_runner(loaded: Any, num_pages: int = 64) -> ModelRunner:
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(loaded, pool, platform_for(loaded.device))


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )


def run_to_completion(
    runner: ModelRunner,
    make_entry: Any,
    requests: list[Request],
    stop_ids: set[int],
    first_page: int = 0,
) -> None:
    """A minimal engine loop: prefill everything in one batch, then decode all together."""
    tables = []
    for r in requests:
        n = -(-(len(r.prompt) + r.max_new_tokens) // PAGE)
        tables.append(list(range(first_page, first_page + n)))
        first_page += n
    entries = [make_entry(r, r.prompt, 0, t, PAGE) for r, t in zip(requests, tables)]
    live = list(range(len(requests)))
    while live:
        tokens = [t for (t,) in runner.step(Batch(entries, PAGE)).tokens]
        still = []
        for i, tok in zip(live, tokens):
            r = requests[i]
            r.output.append(tok)
            if tok not in stop_ids and len(r.output) < r.max_new_tokens:
                still.append(i)
        live = still
        entries = [
            make_entry(
                requests[i], requests[i].output[-1:], requests[i].num_tokens - 1, tables[i], PAGE
            )
            for i in live
        ]


def test_greedy_continuations_equal_transformers_generate(
    loaded_fp32: Any, hf_model: Any, tokenizer: Any, make_entry: Any
) -> None:
    max_new = 16
    prompts = [chat_ids(tokenizer, text) for text in CHATS]
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    requests = [Request(i, p, greedy) for i, p in enumerate(prompts)]
    stop = set(loaded_fp32.config.eos_token_ids)
    run_to_completion(new_runner(loaded_fp32), make_entry, requests, stop)
    for req, prompt in zip(requests, prompts):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=sorted(stop),
                pad_token_id=sorted(stop)[0],
            )
        assert req.output == out[0, len(prompt) :].tolist(), CHATS[req.id]


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(
    loaded_fp32: Any, tokenizer: Any, make_entry: Any
) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_new_tokens=8)
    prompt = chat_ids(tokenizer, CHATS[1])
    alone = Request("alone", prompt, seeded)
    run_to_completion(new_runner(loaded_fp32), make_entry, [alone], set())
    together = Request("together", prompt, seeded)
    others = [
        Request(
            0, chat_ids(tokenizer, CHATS[0]), SamplingParams(temperature=1.0, max_new_tokens=8)
        ),
        Request(
            2,
            chat_ids(tokenizer, CHATS[2]),
            SamplingParams(temperature=0.5, seed=7, max_new_tokens=8),
        ),
    ]
    run_to_completion(new_runner(loaded_fp32), make_entry, [others[0], together, others[1]], set())
    assert together.output == alone.output


def test_entries_that_do_not_sample_get_minus_one(loaded_fp32: Any, make_entry: Any) -> None:
    runner = new_runner(loaded_fp32, 8)
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    req_a, req_b = Request("a", [1, 2, 3], greedy), Request("b", [4, 5], greedy)
    batch = Batch(
        [
            make_entry(req_a, [1, 2, 3], 0, [0], PAGE, False),
            make_entry(req_b, [4, 5], 0, [1], PAGE),
        ],
        PAGE,
    )
    tokens = runner.step(batch).tokens
    assert tokens[0] == [] and len(tokens[1]) == 1
    assert 0 <= tokens[1][0] < loaded_fp32.config.vocab_size


def test_bad_batches_raise_value_error_with_debug_checks(loaded_fp32: Any, make_entry: Any) -> None:
    runner = new_runner(loaded_fp32, 8)
    runner.debug_checks = True
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="page_size"):
        runner.step(Batch([make_entry(Request("a", [1], params), [1], 0, [0], 4)], 4))
    bad_token = make_entry(Request("a", [10**6], params), [10**6], 0, [0], PAGE)
    with pytest.raises(ValueError, match="input_ids"):
        runner.step(Batch([bad_token], PAGE))
    bad_page = make_entry(Request("a", [1], params), [1], 0, [99], PAGE)
    with pytest.raises(ValueError, match="pages"):
        runner.step(Batch([bad_page], PAGE))


def test_pool_that_does_not_fit_the_model_is_rejected(loaded_fp32: Any) -> None:
    cfg = loaded_fp32.config
    with pytest.raises(ValueError, match="pool"):
        ModelRunner(
            loaded_fp32, KVPool(cfg.num_layers - 1, 4, PAGE, cfg.num_kv_heads, cfg.head_dim),
            platform_for(loaded_fp32.device),
        )
