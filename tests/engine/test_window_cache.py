"""The window-aware pool on a real (tiny, random) Gemma 3 with 5:1-like window layers: the
window layers' KV lives in a few window slots, hits are cut back where it is gone, and the
answers are the same bits as with every layer of every page kept and with no cache at all."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import assert_idle_accounting

from engine import Engine, SamplingParams
from engine.model.bringup.load import load_model
from engine.model.kv_pool import KVPool
from workloads.checkpoints.families import WINDOW, build

PAGE = 4
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("gemma3-window")
    build("gemma3", path)
    return load_model(path, "cpu", "float32")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def _prompts() -> list[list[int]]:
    system = _ids(3 * WINDOW + 3, 1)  # a shared prefix three windows long, off a page boundary
    first = system + _ids(20, 2)
    return [
        first,
        system + _ids(9, 3),  # a fork past the window
        system[: WINDOW + 2] + _ids(30, 4),  # a fork just past one window
        _ids(70, 5),  # nothing shared: pushes window slots out
        system + _ids(5, 7),
    ]


def test_window_slots_answer_as_every_layer_kept_and_as_no_cache(gemma3: Any) -> None:
    prompts = _prompts()
    runs = {}
    for name, knobs in {
        "window": dict(window_kv_fraction=0.1),  # 10 slots: hits cut back, slots reclaimed
        "whole": dict(window_kv_fraction=0.0),
        "cold": dict(prefix_cache=False, max_batch_tokens=24, max_running=8),
    }.items():
        with Engine(model=gemma3, num_pages=96, page_size=PAGE, **knobs) as eng:
            alone = [eng.generate([prompts[0]], _greedy())[0]]
            # the first conversation goes on: its next turn starts with all it said
            turn = prompts[0] + alone[0].token_ids + _ids(11, 6)
            alone += [eng.generate([p], _greedy())[0] for p in [turn, *prompts[1:]]]
            batched = eng.generate([prompts[0], turn, *prompts[1:]], _greedy())
            assert_idle_accounting(eng)
            runs[name] = (alone, batched, eng.stats().pages)
    window_pages = runs["window"][2]
    assert window_pages.window_slots == 10 and window_pages.window_reclaimed > 0
    assert runs["whole"][2].window_slots == 0
    hits = {name: [o.cached_tokens for o in alone] for name, (alone, _, _) in runs.items()}
    assert sum(hits["window"]) > 0, "no prefix was hit through the window slots"
    assert all(w <= f for w, f in zip(hits["window"], hits["whole"]))
    assert hits["window"] != hits["whole"], "no hit was cut back: the test asks too little"
    reference = runs["cold"][0]
    for name, (alone, batched, _) in runs.items():
        assert len(alone) == len(batched) == len(prompts) + 1
        for ref, a, b in zip(reference, alone, batched):
            assert a.token_ids == b.token_ids == ref.token_ids, name
            assert a.logprobs == b.logprobs == ref.logprobs, name  # the same bits


def test_a_budget_holds_more_pages_when_window_layers_keep_only_their_window(gemma3: Any) -> None:
    cfg = gemma3.config
    window_layers = sum(cfg.is_window_layer(i) for i in range(cfg.num_layers))
    assert 0 < window_layers < cfg.num_layers
    budget = 256 * KVPool.bytes_per_page(
        cfg.num_layers, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    pages = {}
    for fraction in (0.0, 0.25):
        with Engine(model=gemma3, kv_cache_bytes=budget, page_size=PAGE,
                    window_kv_fraction=fraction) as eng:
            stats = eng.stats().pages
            pages[fraction] = (stats.total, stats.window_slots)
    full = cfg.num_layers - window_layers
    assert pages[0.0] == (256, 0)
    total, slots = pages[0.25]
    assert total == int(256 * cfg.num_layers / (full + 0.25 * window_layers))
    assert slots == -(-total // 4)


def test_a_window_pool_refuses_to_write_or_read_a_page_without_its_slot() -> None:
    pool = KVPool(2, 4, 2, 1, 4, window_layers=[0], window_pages=2)
    slot_of = np.array([1, -1, 0, -1], dtype=np.int64)
    pool.attach_window(slot_of)
    k = torch.arange(8, dtype=torch.float32).view(2, 1, 4)
    pool.write(0, torch.tensor([0, 1]), k, k)  # page 0 -> window slot 1
    assert torch.equal(pool.k_cache[0][1], k)
    pool.write(1, torch.tensor([2, 3]), k, k)  # a full layer: page 1 itself
    assert torch.equal(pool.k_cache[1][1], k)
    with pytest.raises(RuntimeError, match="no window slot"):
        pool.write(0, torch.tensor([2]), k[:1], k[:1])  # page 1 has none
    pages = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert pool.window_pages_of(pages).tolist() == [1, 0, 0]
    pool.check_window([0, 3], pages, [5], window=2)  # reads only page 2: fine
    with pytest.raises(RuntimeError, match="window-layer KV is gone"):
        pool.check_window([0, 3], pages, [3], window=2)  # position 2 is on page 1
    with pytest.raises(RuntimeError, match="not whole"):
        pool.read_pages([0])
    assert pool.num_bytes == 4 * (2 * 2 * 4) * 2 + 4 * (4 * 2 * 4) * 2
