"""KV tiers with the real model: answers served from host memory or disk equal answers with no
cache (and transformers'), loaded pages hold the very bits that were computed, a restarted
engine gets its hits back from disk, damaged files are misses, tenants never meet below the
pool, and aborts and preemption around loads lose no page."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import CHAT_PROMPTS, assert_idle_accounting, greedy, user

from engine import Engine

# Three ~170-token documents, each asked about twice: a 20-page pool (320 tokens) holds
# about one of them, so the second round finds its document evicted.
DOCS = [
    " ".join(f"Record {d}.{i}: the {w} measured {d * 13 + i} units." for i in range(14))
    for d, w in enumerate(["river", "engine", "garden"])
]
PROMPTS = [f"{doc}\nQuestion {q}: which record is largest?" for q in range(2) for doc in DOCS]
POOL_PAGES = 20
NEW = 4


@pytest.fixture(scope="module")
def reference(loaded_fp32: Any) -> list[list[int]]:
    """Greedy answers with nothing cached at all."""
    with Engine(model=loaded_fp32, num_pages=256, prefix_cache=False) as eng:
        return [out.token_ids for out in eng.generate(PROMPTS, greedy(NEW))]


def run_one_by_one(eng: Engine) -> list[list[int]]:
    return [eng.generate([prompt], greedy(NEW))[0].token_ids for prompt in PROMPTS]


@pytest.mark.parametrize(
    "tiers",
    [
        {"kv_host_bytes": 1 << 30},
        {"disk": True},
        {"kv_host_bytes": 6 << 20, "disk": True},  # host holds ~8 pages: the rest spills
    ],
    ids=["host", "disk", "host+disk"],
)
def test_answers_loaded_from_each_tier_equal_answers_with_no_cache(
    make_engine, reference, tmp_path: Path, tiers: dict[str, Any]
) -> None:
    kwargs = {k: v for k, v in tiers.items() if k != "disk"}
    if tiers.get("disk"):
        kwargs["kv_disk_dir"] = tmp_path
    eng = make_engine(num_pages=POOL_PAGES, **kwargs)
    assert run_one_by_one(eng) == reference
    stats = eng.stats()
    assert stats.counters.evicted_pages > 0
    loaded = stats.counters.cached_tokens_host + stats.counters.cached_tokens_disk
    assert loaded > 0, "the second round should load its documents back"
    if "kv_host_bytes" in tiers:
        assert stats.counters.cached_tokens_host > 0 and stats.tiers.loaded_host > 0
    if tiers.get("disk"):
        assert stats.tiers.written_disk > 0
    assert stats.counters.cached_tokens == stats.counters.cached_tokens_pool + loaded
    assert_idle_accounting(eng)


def _tree_pages(eng: Engine) -> dict[int, bytes]:
    """Content address -> KV bytes of every page the pool's tree holds now (engine idle)."""
    assert eng.wait_idle(timeout=60)
    kv = eng._loop._kv
    pool = eng._loop._runner.pool
    pages = kv.tree.walk_pages()
    return dict(zip((p.key for p in pages), pool.read_pages([p.page for p in pages])))


def test_loaded_pages_hold_the_bits_they_were_computed_with(make_engine) -> None:
    roomy = make_engine(num_pages=256)
    roomy.generate([PROMPTS[0]], greedy(NEW))
    computed = _tree_pages(roomy)
    tight = make_engine(num_pages=POOL_PAGES, kv_host_bytes=1 << 30)
    tight.generate([PROMPTS[0]], greedy(NEW))
    for prompt in PROMPTS[1:3]:  # push PROMPTS[0]'s document out of the pool
        tight.generate([prompt], greedy(NEW))
    out = tight.generate([PROMPTS[3]], greedy(NEW))[0]  # the same document, loaded back
    assert tight.stats().counters.cached_tokens_host > 0 and out.cached_tokens > 0
    loaded = _tree_pages(tight)
    shared = set(computed) & set(loaded)
    assert len(shared) >= out.cached_tokens // 16
    assert all(loaded[key] == computed[key] for key in shared)


def test_a_restarted_engine_gets_its_hits_back_from_disk(
    loaded_fp32: Any, reference, tmp_path: Path
) -> None:
    with Engine(model=loaded_fp32, num_pages=256, kv_disk_dir=tmp_path) as first:
        first.generate(PROMPTS[:3], greedy(NEW))  # nothing evicted: close() writes them down
    with Engine(model=loaded_fp32, num_pages=256, kv_disk_dir=tmp_path) as second:
        outs = second.generate(PROMPTS, greedy(NEW))
        stats = second.stats()
        first_prompt = len(second.encode(PROMPTS[0]))
    assert [o.token_ids for o in outs] == reference
    assert stats.counters.cached_tokens_disk > 0 and stats.tiers.corrupt == 0
    assert outs[0].cached_tokens == (first_prompt - 1) // 16 * 16
    # Another page size is another KV layout: its store never reads these files.
    with Engine(model=loaded_fp32, num_pages=512, page_size=8, kv_disk_dir=tmp_path) as other:
        other.generate(PROMPTS[:1], greedy(NEW))
        assert other.stats().counters.cached_tokens == 0
    stores = sorted(p.parent.name for p in tmp_path.glob("*/store.json"))
    assert len(stores) == 2


def test_everything_the_disk_tier_writes_is_private_under_a_permissive_umask(
    loaded_fp32: Any, tmp_path: Path
) -> None:
    """Page files hold tenants' token ids, store.json names the model they ran on: every
    directory the engine creates for the tier is 0700, every file 0600 (store.json was 0644,
    the directories 0775 under this umask)."""
    old = os.umask(0o002)
    try:
        with Engine(model=loaded_fp32, num_pages=256, kv_disk_dir=tmp_path / "kv") as eng:
            eng.generate(PROMPTS[:1], greedy(NEW))  # close() writes its pages down
    finally:
        os.umask(old)
    found = {p.relative_to(tmp_path): p.lstat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert any(p.name == "store.json" for p in found) and any(p.suffix == ".kv" for p in found)
    wrong = {
        str(p): oct(mode) for p, mode in found.items()
        if mode != (0o700 if (tmp_path / p).is_dir() else 0o600)
    }
    assert wrong == {}


def test_damaged_page_files_are_misses_and_answers_stay_exact(
    loaded_fp32: Any, reference, tmp_path: Path
) -> None:
    with Engine(model=loaded_fp32, num_pages=256, kv_disk_dir=tmp_path) as first:
        first.generate(PROMPTS[:3], greedy(NEW))
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for i, path in enumerate(files):
        raw = path.read_bytes()
        if i % 2:  # truncated
            path.write_bytes(raw[: len(raw) // 3])
        else:  # one flipped bit in the KV
            middle = len(raw) // 2
            path.write_bytes(raw[:middle] + bytes([raw[middle] ^ 0x10]) + raw[middle + 1 :])
    with Engine(model=loaded_fp32, num_pages=256, kv_disk_dir=tmp_path) as second:
        outs = second.generate(PROMPTS, greedy(NEW))
        stats = second.stats()
    assert [o.token_ids for o in outs] == reference
    assert stats.tiers.corrupt > 0


def test_tenants_never_hit_each_others_pages_below_the_pool(make_engine, tmp_path) -> None:
    eng = make_engine(num_pages=POOL_PAGES, kv_host_bytes=1 << 30, kv_disk_dir=tmp_path)
    for prompt in PROMPTS[:3]:
        eng.generate([prompt], greedy(NEW), namespace="alice")
    out = eng.generate([PROMPTS[0]], greedy(NEW), namespace="mallory")[0]
    assert out.cached_tokens == 0
    stats = eng.stats()
    assert stats.counters.cached_tokens_host == stats.counters.cached_tokens_disk == 0
    again = eng.generate([PROMPTS[0]], greedy(NEW), namespace="alice")[0]
    assert again.cached_tokens > 0 and eng.stats().counters.cached_tokens_host > 0


def test_preemption_and_aborts_around_loads_leave_every_page_accounted_for(
    make_engine, chat_ids, hf_greedy
) -> None:
    # The pressure recipe of test_api_greedy (preemption, eviction) with a host tier under
    # the pool: evicted and preempted requests' pages go down and come back up.
    eng = make_engine(
        page_size=4, num_pages=40, kv_host_bytes=1 << 30,
        reserve_ratio_init=0.0, reserve_margin=0.0, reserve_ratio_min=0.0,
    )
    prompts = [user(p) for p in CHAT_PROMPTS] * 2
    expected = [hf_greedy(ids, 12) for ids in chat_ids] * 2
    outs = eng.generate(prompts, greedy(12))
    assert [o.token_ids for o in outs] == expected
    stats = eng.stats()
    assert stats.counters.preemptions > 0 and stats.tiers.loaded_host > 0
    # Now abort streams from another thread while the loop admits (and loads) requests.
    handles = [eng.submit(p, greedy(16), stream=True) for p in prompts]
    aborter = threading.Thread(target=lambda: [h.abort() for h in handles[::2]])
    aborter.start()
    results = [h.result() for h in handles]
    aborter.join()
    assert {r.finish_reason for r in results[1::2]} <= {"length", "stop"}
    assert_idle_accounting(eng)  # the loop's idle check ran KVManager.check, tiers included


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_host_bytes": -1}, "kv_host_bytes"),
        ({"kv_host_bytes": "2G"}, "kv_host_bytes"),
        ({"kv_disk_bytes": 1 << 20}, "kv_disk_bytes"),
        ({"kv_host_bytes": 1 << 20, "prefix_cache": False}, "kv_host_bytes"),
        ({"kv_disk_dir": 42}, "kv_disk_dir"),
    ],
)
def test_bad_tier_settings_raise_value_errors_naming_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        Engine(model="/nonexistent-checked-later", **kwargs)


def test_a_disk_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir"):
        Engine(kv_disk_dir=target)


def test_empty_tiers_report_their_budgets(make_engine, tmp_path: Path) -> None:
    """An empty store's budget is still its budget (a store with no pages is falsy: the
    stats read 0 for both budgets until the first page was written)."""
    eng = make_engine(num_pages=POOL_PAGES, kv_host_bytes=8 << 20, kv_disk_dir=tmp_path,
                      kv_disk_bytes=16 << 20)
    tiers = eng.stats().tiers
    assert (tiers.host_pages, tiers.disk_pages) == (0, 0)
    assert (tiers.host_budget_bytes, tiers.disk_budget_bytes) == (8 << 20, 16 << 20)
