"""Many callers at once, from threads and from asyncio tasks, all get their own right answer."""

from __future__ import annotations

import asyncio
import threading

from engine_helpers import assert_idle_accounting, greedy

PROMPTS = [f"Item {i}: the number after {i * 3} is" for i in range(16)]
NEW_TOKENS = 6


def _expected(tokenizer, hf_greedy) -> list[list[int]]:
    return [hf_greedy(tokenizer.encode(p), NEW_TOKENS) for p in PROMPTS]


def test_sixteen_threads_times_four_requests(engine, tokenizer, hf_greedy) -> None:
    expected = _expected(tokenizer, hf_greedy)
    results: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            for k in range(4):
                which = (thread + k) % len(PROMPTS)
                [out] = engine.generate(PROMPTS[which], greedy(NEW_TOKENS))
                results[(thread, k)] = out.token_ids
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert len(results) == 64
    for (thread, k), tokens in results.items():
        assert tokens == expected[(thread + k) % len(PROMPTS)]
    assert_idle_accounting(engine)


def test_sixty_four_concurrent_asyncio_tasks(engine, tokenizer, hf_greedy) -> None:
    expected = _expected(tokenizer, hf_greedy)

    async def one(i: int) -> list[int]:
        if i % 2:
            [out] = await engine.agenerate(PROMPTS[i % 16], greedy(NEW_TOKENS))
            return out.token_ids
        deltas = []
        async for item in engine.astream(PROMPTS[i % 16], greedy(NEW_TOKENS)):
            deltas.append(item)
        final = deltas.pop()
        assert "".join(deltas) == final.text
        return final.token_ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(main())
    assert results == [expected[i % 16] for i in range(64)]
    assert_idle_accounting(engine)


def test_agenerate_batch_returns_outputs_in_input_order(engine, tokenizer, hf_greedy) -> None:
    expected = _expected(tokenizer, hf_greedy)
    outs = asyncio.run(engine.agenerate(PROMPTS[::-1], greedy(NEW_TOKENS)))
    assert [o.token_ids for o in outs] == expected[::-1]
