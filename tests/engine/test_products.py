"""Our matrix products: equal to a float64 reference within rounding at every shape the model
uses, and each row's result bit-identical whatever else shares the call: any row count, any
split of the rows into calls, one thread or two, with every fused prologue and epilogue."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.cpu.products import (
    NativeRowOps,
    PackedWeight,
    load_products,
    tiles_keep_their_contract,
    tiles_usable,
)
from engine.model.platform import GELU_MUL, NONE, RMSNORM, SILU_MUL

# SmolLM2-135M's products (K, N): fused qkv, o, fused gate/up, down, LM head; and odd sizes.
MODEL_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = load_products()
    assert module is not None, "our products did not build on this machine"
    return module


def reference(x: torch.Tensor, w: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """float64 product; the bf16 dot path rounds x to bfloat16 first, as documented."""
    if "bf16dot" in packed.path() and w.dtype == torch.bfloat16:
        x = x.to(torch.bfloat16)
    return x.double() @ w.double().T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_products_equal_a_float64_reference_at_the_models_shapes(
    kernel: ModuleType, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(37, k, generator=gen)
    packed = PackedWeight(kernel, w)
    got = packed(x, threads=2).double()
    want = reference(x, w, packed)
    # fp32 sums of K products: error ~ sqrt(K) ulps of the terms' magnitude
    tol = 1e-5 * (k**0.5) * want.abs().max()
    assert (got - want).abs().max() <= tol


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 300),
    cut=st.integers(0, 300),
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from(((576, 960), (1536, 576), (40, 70))),
    prologue=st.sampled_from((NONE, RMSNORM, SILU_MUL)),
    bias=st.booleans(),
    residual=st.booleans(),
)
def test_each_row_is_bit_identical_whatever_shares_its_call(
    kernel: ModuleType,
    rows: int,
    cut: int,
    dtype: torch.dtype,
    shape: tuple[int, int],
    prologue: int,
    bias: bool,
    residual: bool,
) -> None:
    """All rows in one call on one thread is the reference; the same rows split into two
    calls at ``cut``, one row at a time, and on two threads must give the same bits."""
    k, n = shape
    gen = torch.Generator().manual_seed(rows * 7 + cut)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    packed = PackedWeight(kernel, w, b)
    width = 2 * k if prologue == SILU_MUL else k
    x = torch.randn(rows, width, generator=gen)
    res = torch.randn(rows, n, generator=gen) if residual else None
    norm = torch.rand(k, generator=gen) + 0.5

    def run(a: int, z: int, threads: int) -> torch.Tensor:
        return packed(
            x[a:z], prologue, norm if prologue == RMSNORM else None, 1e-5,
            None if res is None else res[a:z], threads,
        )

    whole = run(0, rows, 1)
    c = min(cut, rows)
    assert torch.equal(torch.cat([run(0, c, 1), run(c, rows, 2)]), whole)
    assert torch.equal(run(0, rows, 2), whole)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(run(i, i + 1, 1), whole[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count_gives_each_row_its_one_row_result(
    kernel: ModuleType, dtype: torch.dtype
) -> None:
    """The kernel tiles a call by its row count (wide tiles for one or two rows, tall tiles
    of one panel up to 28, blocks of 96 beyond): every count across those boundaries gives
    each row the bits it gets alone, with a fused prologue and a residual."""
    gen = torch.Generator().manual_seed(5)
    k, n = 576, 960
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    packed = PackedWeight(kernel, w, torch.randn(n, generator=gen))
    norm = torch.rand(k, generator=gen) + 0.5
    x = torch.randn(100, k, generator=gen)
    res = torch.randn(100, n, generator=gen)

    def run(rows: slice) -> torch.Tensor:
        return packed(x[rows], RMSNORM, norm, 1e-5, res[rows], threads=2)

    alone = torch.cat([run(slice(i, i + 1)) for i in range(100)])
    for rows in [*range(2, 31), 95, 96, 97, 100]:
        assert torch.equal(run(slice(0, rows)), alone[:rows]), f"{rows} rows"


def test_fused_prologues_and_epilogues_compute_what_they_name(kernel: ModuleType) -> None:
    k, n = 64, 96
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight(kernel, w, b)
    x = torch.randn(5, k, generator=gen)
    res = torch.randn(5, n, generator=gen)
    norm = torch.rand(k, generator=gen)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    torch.testing.assert_close(packed(x, RMSNORM, norm, 1e-5), normed @ w.T + b)
    gu = torch.randn(5, 2 * k, generator=gen)
    act = torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]
    torch.testing.assert_close(packed(gu, SILU_MUL, residual=res), res + act @ w.T + b)


def test_silu_prologue_is_accurate_and_finite_across_the_float32_range(
    kernel: ModuleType,
) -> None:
    """The vectorised exp under SiLU clamps where float32's exp would overflow: gates far
    past +-88 still give silu(g) (g or -0), and ordinary ones match torch's to float32's
    precision, in whole vectors and in the scalar tail alike (k = 37)."""
    k = 37
    gates = torch.tensor([-300.0, -120.0, -88.5, -87.5, -20.0, -1e-3, 0.0, 1e-3, 3.0, 87.5, 88.5,
                          120.0, 300.0])
    gate = gates.repeat(k // len(gates) + 1)[:k]
    eye = torch.eye(k)
    packed = PackedWeight(kernel, eye)  # y = silu(gate) * up exactly, column by column
    up = torch.linspace(-2.0, 2.0, k)
    got = packed(torch.cat([gate, up])[None], SILU_MUL)[0]
    want = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


def test_gelu_prologue_is_tanh_gelu_across_the_float32_range(kernel: ModuleType) -> None:
    """Gemma's GELU (transformers' gelu_pytorch_tanh) times up, finite where the gate is far
    past float32's exp range, in whole vectors and the scalar tail (k = 37)."""
    k = 37
    gates = torch.tensor([-300.0, -60.0, -10.0, -3.0, -1e-3, 0.0, 1e-3, 0.5, 3.0, 10.0, 60.0,
                          300.0])
    gate = gates.repeat(k // len(gates) + 1)[:k]
    packed = PackedWeight(kernel, torch.eye(k))
    up = torch.linspace(-2.0, 2.0, k)
    got = packed(torch.cat([gate, up])[None], GELU_MUL)[0]
    want = (torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)


def test_row_ops_compute_what_they_name_and_keep_each_rows_bits(kernel: ModuleType) -> None:
    """RMSNorm of rows and of each head of a row (plus a residual; in place for q/k heads), and
    the soft cap: equal to float64, and a row's bits the same in a call of 1 row or of 50, on
    one thread or two, at widths with and without a scalar tail."""
    rows = NativeRowOps(kernel)
    gen = torch.Generator().manual_seed(4)
    for k, heads in ((64, 1), (96, 3), (37, 1)):
        x = torch.randn(50, k, generator=gen) * 3
        w = torch.randn(k, generator=gen)
        res = torch.randn(50, k, generator=gen)
        seg = x.double().view(50, heads, -1)
        normed = (seg * torch.rsqrt(seg.pow(2).mean(-1, keepdim=True) + 1e-6)).view(50, k)
        want = res.double() + normed * w.double()
        got = rows.rms_norm(x, w, 1e-6, heads, res, threads=2)
        torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=2e-6)
        for r in (0, 17, 49):
            assert torch.equal(rows.rms_norm(x[r : r + 1], w, 1e-6, heads, res[r : r + 1]), got[r : r + 1])
        inplace = x.clone()
        rows.rms_norm(inplace[:, : k], w, 1e-6, heads, in_place=True)
        assert torch.equal(inplace, rows.rms_norm(x, w, 1e-6, heads))
        capped = rows.softcap_(x.clone() * 20, 30.0, threads=2)
        want_cap = torch.tanh(x.double() * 20 / 30) * 30
        torch.testing.assert_close(capped, want_cap.float(), rtol=0, atol=3e-5)
        for r in (0, 49):
            assert torch.equal(rows.softcap_(x[r : r + 1].clone() * 20, 30.0), capped[r : r + 1])
    with pytest.raises(RuntimeError, match="heads"):
        rows.rms_norm(torch.zeros(2, 10), torch.ones(10), 1e-6, 3)
    with pytest.raises(RuntimeError, match="cap"):
        rows.softcap_(torch.zeros(2, 10), 0.0)


def test_a_weight_that_does_not_match_the_input_is_refused(kernel: ModuleType) -> None:
    packed = PackedWeight(kernel, torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="features"):
        packed(torch.randn(3, 65))


def test_a_build_without_tiles_says_why_and_refuses_the_tile_layout(kernel: ModuleType) -> None:
    """Where the build has no AMX path (every machine without amx_bf16), bfloat16 weights keep
    today's layout, the self-test names the reason, and the tile layout is a RuntimeError."""
    if kernel.tiles_built():
        pytest.skip("this build has the AMX tile path (the tile tests below cover it)")
    assert not tiles_usable(kernel)
    assert "no AMX tile path" in (tiles_keep_their_contract(kernel) or "")
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="AMX"):
        kernel.pack_tiles(w)
    fake = torch.zeros(4, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMX"):
        kernel.dense(torch.zeros(1, 64), fake, 64, NONE, None, 0.0, None, None, 1)


needs_tiles = pytest.mark.skipif(
    not (load_products() is not None and tiles_usable(load_products())),
    reason="no usable AMX tiles here (needs amx_bf16 granted by Linux: Sapphire Rapids or later)",
)


@needs_tiles
def test_tile_products_pass_their_self_test_in_this_process(kernel: ModuleType) -> None:
    assert tiles_keep_their_contract(kernel) is None


@needs_tiles
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_tile_rows_are_bit_identical_in_calls_of_1_to_512_rows(
    kernel: ModuleType, shape: tuple[int, int]
) -> None:
    """The AMX product keeps the portable kernel's contract: a row's bits are the same alone,
    in calls of any row count up to 512, cut anywhere, on one thread or two, with the fused
    RMSNorm, bias and residual; and within float32 rounding of a float64 reference."""
    k, n = shape
    gen = torch.Generator().manual_seed(k * 3 + n)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    packed = PackedWeight(kernel, w, torch.randn(n, generator=gen), tiles=True)
    assert packed.tiles and packed.path() == "amx-tiles/bf16"
    x = torch.randn(512, k, generator=gen)
    res = torch.randn(512, n, generator=gen)
    norm = torch.rand(k, generator=gen) + 0.5

    def run(a: int, z: int, threads: int) -> torch.Tensor:
        return packed(x[a:z], RMSNORM, norm, 1e-5, res[a:z], threads)

    whole = run(0, 512, 2)
    for rows in (1, 2, 15, 16, 17, 31, 33, 100, 255, 511):
        assert torch.equal(run(0, rows, 1), whole[:rows]), f"{rows} rows"
        assert torch.equal(run(512 - rows, 512, 2), whole[512 - rows :]), f"last {rows} rows"
    plain = PackedWeight(kernel, w, tiles=True)(x, threads=2).double()
    want = x.bfloat16().double() @ w.double().T
    assert (plain - want).abs().max() <= 1e-5 * (k**0.5) * want.abs().max()
