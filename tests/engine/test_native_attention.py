"""The native batch-invariant attention kernel: it builds on this machine, it computes softmax
attention over each query's own keys, and a query's output is bit-identical whatever shares
the call (other requests, a prefill chunk, a lone decode), however the keys are paged, and
with one thread or two."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.cpu import exact_attention

HKV, G, D = 3, 3, 64
SCALE = D**-0.5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = exact_attention.load_kernel()
    assert module is not None, "the native attention kernel did not build on this machine"
    return module


class Pool:
    """Sequences' K/V stored in shuffled pages of a pool full of stale values."""

    def __init__(
        self,
        seqs_k: list[torch.Tensor],
        seqs_v: list[torch.Tensor],
        page_size: int,
        dtype: torch.dtype,
        seed: int,
    ) -> None:
        need = sum(-(-k.shape[0] // page_size) for k in seqs_k)
        gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(need + 2, page_size, HKV, D, generator=gen).to(dtype)
        self.v = torch.randn(need + 2, page_size, HKV, D, generator=gen).to(dtype)
        free = random.Random(seed).sample(range(need + 2), need + 2)
        self.tables: list[list[int]] = []
        for k, v in zip(seqs_k, seqs_v):
            pages = [free.pop() for _ in range(-(-k.shape[0] // page_size))]
            self.tables.append(pages)
            for pos in range(k.shape[0]):
                page, off = pages[pos // page_size], pos % page_size
                self.k[page, off] = k[pos].to(dtype)
                self.v[page, off] = v[pos].to(dtype)

    def table(self, seq: int, length: int) -> list[int]:
        page_size = self.k.shape[1]
        return self.tables[seq][: -(-length // page_size)]


def attend(
    kernel: ModuleType,
    pool: Pool,
    q: torch.Tensor,
    qo: list[int],
    kv: list[int],
    seqs: list[int],
    threads: int = 1,
) -> torch.Tensor:
    tables = [pool.table(s, n) for s, n in zip(seqs, kv)]
    plan = exact_attention.plan_native(qo, kv, tables, CPU)
    return exact_attention.attend(kernel, q, pool.k, pool.v, plan, G, SCALE, threads)


def softmax_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float
) -> torch.Tensor:
    """Softmax attention in float64 for one query ``[hkv * group, dim]`` at ``pos`` over
    ``keys``/``values`` ``[length, hkv, dim]``; float32 out."""
    hkv, dim = keys.shape[1], keys.shape[2]
    qq = q.double().view(hkv, -1, dim)
    kk, vv = keys[: pos + 1].double(), values[: pos + 1].double()
    s = torch.einsum("hgd,lhd->hgl", qq, kk) * scale
    return torch.einsum("hgl,lhd->hgd", s.softmax(-1), vv).reshape(-1, dim).float()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Softmax attention in float64 for one query ``[HKV * G, D]`` at ``pos``."""
    return softmax_attention(q, k, v, pos, SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_softmax_attention_over_each_querys_own_keys(
    kernel: ModuleType, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    lens = [137, 300, 5]
    ks = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in lens]
    pool = Pool(ks, vs, 16, dtype, seed=1)
    qo = [100, 1, 1]  # a prefill chunk after 37 cached tokens, two decodes
    q = torch.randn(sum(qo), HKV * G, D, generator=gen)
    out = attend(kernel, pool, q, qo, lens, [0, 1, 2])
    t = 0
    for s, (n, length) in enumerate(zip(qo, lens)):
        for j in range(n):
            want = reference(q[t], ks[s], vs[s], length - n + j)
            torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)
            t += 1


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    shared=st.integers(0, 200),
    own=st.lists(st.integers(1, 150), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 3, 16, 64, 128]),
    bf16=st.booleans(),
)
def test_query_gets_the_same_bits_in_any_batch_chunk_paging_and_thread_count(
    kernel: ModuleType, data: st.DataObject, shared: int, own: list[int], page_size: int, bf16: bool
) -> None:
    """Requests share a prefix (the cascade case) and add their own tokens; each runs either
    as a prefill chunk of its last tokens or as a decode. Every query's output equals the same
    query as a lone decode, over a pool with page size 16, on one thread."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(len(own) * 1000 + shared)
    prefix = torch.randn(shared, HKV, D, generator=gen), torch.randn(shared, HKV, D, generator=gen)
    ks, vs = [], []
    for n in own:
        ks.append(torch.cat([prefix[0], torch.randn(n, HKV, D, generator=gen)]))
        vs.append(torch.cat([prefix[1], torch.randn(n, HKV, D, generator=gen)]))
    lens = [k.shape[0] for k in ks]
    qo = [data.draw(st.integers(1, n), label=f"chunk {i}") for i, n in enumerate(lens)]
    q = torch.randn(sum(qo), HKV * G, D, generator=gen)
    threads = data.draw(st.sampled_from([1, 2]), label="threads")

    batch_pool = Pool(ks, vs, page_size, dtype, seed=3)
    lone_pool = Pool(ks, vs, 16, dtype, seed=4)
    batched = attend(kernel, batch_pool, q, qo, lens, list(range(len(lens))), threads)
    t = 0
    for s, (n, length) in enumerate(zip(qo, lens)):
        for j in range(n):
            pos = length - n + j
            alone = attend(kernel, lone_pool, q[t : t + 1], [1], [pos + 1], [s])
            assert torch.equal(alone[0], batched[t]), (s, j)
            t += 1


@pytest.mark.parametrize("dim, hkv, group", [(64, 3, 3), (32, 2, 4), (96, 1, 8), (128, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_on_shared_prefix_pages_match_the_reference_and_a_lone_decode(
    kernel: ModuleType, dim: int, hkv: int, group: int, dtype: torch.dtype
) -> None:
    """Decodes whose tables share a prefix's pages (their query heads read each shared block
    together, in register tiles of several tokens) next to a prefill chunk, at head_dims and
    group sizes other than the model's: every query matches float64 softmax attention and
    equals itself as a lone decode, with one thread or two."""
    page_size, shared, own = 16, 144, [1, 40, 77, 64, 3]
    gen = torch.Generator().manual_seed(dim * 10 + group)
    k_pool = torch.randn(64, page_size, hkv, dim, generator=gen).to(dtype)
    v_pool = torch.randn(64, page_size, hkv, dim, generator=gen).to(dtype)
    free = random.Random(dim + group).sample(range(64), 64)
    common = [free.pop() for _ in range(shared // page_size)]
    tables = [common + [free.pop() for _ in range(-(-n // page_size))] for n in own]
    lens = [shared + n for n in own]
    qo = [1, 1, 1, 1, 20]  # four decodes, and a chunk across the prefix's end
    q = torch.randn(sum(qo), hkv * group, dim, generator=gen)
    scale = dim**-0.5

    def run(
        qq: torch.Tensor, qo: list[int], kv: list[int], seqs: list[int], threads: int = 1
    ) -> torch.Tensor:
        tabs = [tables[s][: -(-n // page_size)] for s, n in zip(seqs, kv)]
        plan = exact_attention.plan_native(qo, kv, tabs, CPU)
        return exact_attention.attend(kernel, qq, k_pool, v_pool, plan, group, scale, threads)

    for threads in (1, 2):
        batched = run(q, qo, lens, [0, 1, 2, 3, 4], threads)
        t = 0
        for s, (n, length) in enumerate(zip(qo, lens)):
            keys = k_pool[tables[s]].reshape(-1, hkv, dim)
            values = v_pool[tables[s]].reshape(-1, hkv, dim)
            for j in range(n):
                pos = length - n + j
                want = softmax_attention(q[t], keys, values, pos, scale)
                torch.testing.assert_close(batched[t], want, rtol=1e-5, atol=1e-5)
                alone = run(q[t : t + 1], [1], [pos + 1], [s])
                assert torch.equal(alone[0], batched[t]), (threads, s, j)
                t += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_read_over_all_kv_heads_at_once_keeps_its_lone_bits(
    kernel: ModuleType, dtype: torch.dtype
) -> None:
    """Eight unrelated decodes on two threads are eight units, each over every KV head (a
    block's pages read as whole rows); alone, a decode is one unit per KV head. Which of the
    two computes a query must not change its bits, nor its distance from float64 attention."""
    gen = torch.Generator().manual_seed(8)
    lens = [130, 64, 1, 200, 17, 96, 65, 300]
    ks = [torch.randn(n, HKV, D, generator=gen) for n in lens]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in lens]
    pool = Pool(ks, vs, 16, dtype, seed=8)
    q = torch.randn(len(lens), HKV * G, D, generator=gen)
    batched = attend(kernel, pool, q, [1] * len(lens), lens, list(range(len(lens))), threads=2)
    for s, n in enumerate(lens):
        alone = attend(kernel, pool, q[s : s + 1], [1], [n], [s], threads=2)
        assert torch.equal(alone[0], batched[s]), s
        want = reference(q[s], ks[s].to(dtype), vs[s].to(dtype), n - 1)
        torch.testing.assert_close(batched[s], want, rtol=1e-5, atol=1e-5)


def test_disabled_by_environment_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(exact_attention.DISABLE_ENV, "0")
    assert exact_attention.load_kernel() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_kv_write_equal_the_separate_steps(
    kernel: ModuleType, dtype: torch.dtype
) -> None:
    """``rope_write_attend`` (RoPE, the K/V write and attention in one call, from the fused
    projection's rows) writes the K/V torch's rotation and cast write, and returns what the
    kernel returns for the rotated q over them: a prefill chunk after cached tokens and two
    decodes, one of them on the chunk's own new pages."""
    from engine.model.rope import apply_rope_

    page_size, hq = 16, HKV * G
    gen = torch.Generator().manual_seed(7)
    cached = [40, 0, 75]  # tokens already in each sequence's pages
    qo = [9, 1, 1]
    lens = [c + n for c, n in zip(cached, qo)]
    pages_needed = [-(-n // page_size) for n in lens]
    order = random.Random(7).sample(range(sum(pages_needed) + 3), sum(pages_needed) + 3)
    tables = [[order.pop() for _ in range(n)] for n in pages_needed]
    k_pool = torch.randn(sum(pages_needed) + 3, page_size, HKV, D, generator=gen).to(dtype)
    v_pool = torch.randn(sum(pages_needed) + 3, page_size, HKV, D, generator=gen).to(dtype)
    slots = torch.tensor(
        [tables[s][p // page_size] * page_size + p % page_size
         for s in range(3) for p in range(cached[s], lens[s])],
        dtype=torch.int64,
    )
    positions = torch.tensor([p for s in range(3) for p in range(cached[s], lens[s])])
    qkv = torch.randn(len(slots), (hq + 2 * HKV) * D, generator=gen)
    angles = positions[:, None].float() * (10000.0 ** (-torch.arange(0, D, 2).float() / D))
    cos, sin = angles.cos(), angles.sin()
    plan = exact_attention.plan_native(qo, lens, tables, CPU)

    fused_k, fused_v = k_pool.clone(), v_pool.clone()
    fused = exact_attention.rope_write_attend(
        kernel, qkv, cos, sin, slots, fused_k, fused_v, plan, G, SCALE, threads=2
    )

    qk = qkv[:, : (hq + HKV) * D].clone().unflatten(-1, (hq + HKV, D))
    apply_rope_(qk, cos[:, None], sin[:, None])
    v = qkv[:, (hq + HKV) * D :].unflatten(-1, (HKV, D))
    k_pool.view(-1, HKV, D).index_copy_(0, slots, qk[:, hq:].to(dtype))
    v_pool.view(-1, HKV, D).index_copy_(0, slots, v.to(dtype))
    torch.testing.assert_close(fused_k.float(), k_pool.float(), rtol=0, atol=1e-6 if
                               dtype == torch.float32 else 0.0)
    assert torch.equal(fused_v, v_pool)
    separate = exact_attention.attend(
        kernel, qk[:, :hq].contiguous(), k_pool, v_pool, plan, G, SCALE
    )
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)


def test_fused_call_rejects_a_slot_outside_the_pool(kernel: ModuleType) -> None:
    k_pool = torch.zeros(2, 16, HKV, D)
    plan = exact_attention.plan_native([1], [1], [[0]], CPU)
    qkv = torch.zeros(1, (HKV * G + 2 * HKV) * D)
    half = torch.zeros(1, D // 2)
    with pytest.raises(RuntimeError, match="slots"):
        exact_attention.rope_write_attend(
            kernel, qkv, half, half, torch.tensor([32]), k_pool, k_pool.clone(), plan, G, SCALE
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_long_lone_request_cut_into_parts_keeps_its_bits(
    kernel: ModuleType, dtype: torch.dtype, threads: int
) -> None:
    """A lone decode or verify is one unit per KV head, fewer units than threads want: its
    blocks are cut into parts that threads take apart, and each row's blocks added in order
    afterwards. Its queries keep the bits they get on one thread (one whole unit per head)
    and among other decodes (units over every KV head), and stay close to float64."""
    gen = torch.Generator().manual_seed(threads)
    lens = [2100, 1100, 64, 1, 900, 1500, 20, 700]
    ks = [torch.randn(n, HKV, D, generator=gen) for n in lens]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in lens]
    pool = Pool(ks, vs, 16, dtype, seed=threads)
    verify = torch.randn(9, HKV * G, D, generator=gen)  # the last 9 tokens of request 0
    cut = attend(kernel, pool, verify, [9], [lens[0]], [0], threads=threads)
    whole = attend(kernel, pool, verify, [9], [lens[0]], [0], threads=1)
    assert torch.equal(cut, whole)
    for j in range(9):
        want = reference(verify[j], ks[0].to(dtype), vs[0].to(dtype), lens[0] - 9 + j)
        torch.testing.assert_close(cut[j], want, rtol=1e-5, atol=1e-5)
    q = torch.randn(len(lens), HKV * G, D, generator=gen)
    batched = attend(kernel, pool, q, [1] * len(lens), lens, list(range(len(lens))), threads)
    for s in (0, 1, 5):
        alone = attend(kernel, pool, q[s : s + 1], [1], [lens[s]], [s], threads=threads)
        assert torch.equal(alone[0], batched[s]), s
        want = reference(q[s], ks[s].to(dtype), vs[s].to(dtype), lens[s] - 1)
        torch.testing.assert_close(alone[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim, hkv, group", [(32, 2, 4), (96, 1, 8), (128, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_keep_the_bits_at_other_head_shapes(
    kernel: ModuleType, dim: int, hkv: int, group: int, dtype: torch.dtype
) -> None:
    """At head_dims and group sizes other than the model's, a lone decode and a lone verify
    long enough to be cut into parts on two threads equal themselves on one thread (whole
    units) and float64 softmax attention."""
    page_size, length = 16, 1500
    gen = torch.Generator().manual_seed(dim + hkv)
    pages = length // page_size + 1
    k_pool = torch.randn(pages + 2, page_size, hkv, dim, generator=gen).to(dtype)
    v_pool = torch.randn(pages + 2, page_size, hkv, dim, generator=gen).to(dtype)
    table = random.Random(dim).sample(range(pages + 2), pages)
    keys = k_pool[table].reshape(-1, hkv, dim)
    values = v_pool[table].reshape(-1, hkv, dim)
    scale = dim**-0.5
    for rows in (1, 6):
        q = torch.randn(rows, hkv * group, dim, generator=gen)
        plan = exact_attention.plan_native([rows], [length], [table], CPU)
        cut = exact_attention.attend(kernel, q, k_pool, v_pool, plan, group, scale, 2)
        whole = exact_attention.attend(kernel, q, k_pool, v_pool, plan, group, scale, 1)
        assert torch.equal(cut, whole), rows
        for j in range(rows):
            want = softmax_attention(q[j], keys, values, length - rows + j, scale)
            torch.testing.assert_close(cut[j], want, rtol=1e-5, atol=1e-5)


def capped_window_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float,
    softcap: float, window: int,
) -> torch.Tensor:
    """Float64 attention of one query at ``pos`` with scores capped (cap * tanh(s / cap)) and
    only keys pos - window + 1 .. pos weighed."""
    hkv, dim = keys.shape[1], keys.shape[2]
    lo = max(0, pos + 1 - window) if window else 0
    qq = q.double().view(hkv, -1, dim)
    kk, vv = keys[lo : pos + 1].double(), values[lo : pos + 1].double()
    s = torch.einsum("hgd,lhd->hgl", qq, kk) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hgl,lhd->hgd", s.softmax(-1), vv).reshape(-1, dim).float()


@pytest.mark.parametrize("softcap,window", [(3.0, 0), (0.0, 50), (2.0, 64), (0.0, 1)])
def test_soft_cap_and_sliding_window_are_exact_and_keep_each_querys_bits(
    kernel: ModuleType, softcap: float, window: int
) -> None:
    """Gemma's variants: scores capped before the maximum, keys before the window weighed
    zero. Equal to float64 attention, and each query's bits the same alone, batched, in a
    prefill chunk across the window's edge and in a lone long decode cut into parts."""
    gen = torch.Generator().manual_seed(11)
    lens = [700, 130, 45, 64]
    ks = [torch.randn(n, HKV, D, generator=gen) * 2 for n in lens]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in lens]
    pool = Pool(ks, vs, 16, torch.float32, seed=11)
    scale = 0.3
    qo = [1, 80, 1, 64]  # a long decode, a chunk across the window's edge, a short decode
    q = torch.randn(sum(qo), HKV * G, D, generator=gen) * 2

    def run(qq: torch.Tensor, qo: list[int], kv: list[int], seqs: list[int], threads: int):
        tables = [pool.table(s, n) for s, n in zip(seqs, kv)]
        plan = exact_attention.plan_native(qo, kv, tables, CPU)
        return exact_attention.attend(
            kernel, qq, pool.k, pool.v, plan, G, scale, threads, softcap, window
        )

    batched = run(q, qo, lens, [0, 1, 2, 3], 2)
    t = 0
    for s, (n, length) in enumerate(zip(qo, lens)):
        for j in range(n):
            pos = length - n + j
            want = capped_window_attention(q[t], ks[s], vs[s], pos, scale, softcap, window)
            torch.testing.assert_close(batched[t], want, rtol=1e-5, atol=1e-5)
            if j in (0, n - 1):
                for threads in (1, 2):  # two threads cut a lone query into parts
                    alone = run(q[t : t + 1], [1], [pos + 1], [s], threads)
                    assert torch.equal(alone[0], batched[t]), (s, j, threads)
            t += 1


def test_a_bad_soft_cap_or_window_is_a_runtime_error(kernel: ModuleType) -> None:
    pool = Pool([torch.zeros(4, HKV, D)], [torch.zeros(4, HKV, D)], 16, torch.float32, seed=0)
    plan = exact_attention.plan_native([1], [4], [pool.table(0, 4)], CPU)
    q = torch.zeros(1, HKV * G, D)
    with pytest.raises(RuntimeError, match="softcap"):
        exact_attention.attend(kernel, q, pool.k, pool.v, plan, G, SCALE, 1, -1.0, 0)
    with pytest.raises(RuntimeError, match="window"):
        exact_attention.attend(kernel, q, pool.k, pool.v, plan, G, SCALE, 1, 0.0, -5)
