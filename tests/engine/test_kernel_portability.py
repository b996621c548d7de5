"""The kernels' paths for other machines, built and run on this one: an AVX2 build
(``-march=x86-64-v3``, the Zen 3 EPYC's instruction set) and a build without AVX
(``-march=x86-64``: plain vectors, the C library's fma). The kernels define every sum on fixed
lanes, so their float32 results must be the same bits at every vector width: products with
their fused RMSNorm / SiLU / bias / residual (float32 weights, and bfloat16 weights where no
build has the bf16 dot instruction) and attention over float32 and bfloat16 pools."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from engine.model.cpu import exact_attention, native_build
from engine.model.cpu.machine import cpu_flags
from engine.model.cpu.products import SELF_TEST as PRODUCTS_SELF_TEST
from engine.model.cpu.products import SOURCE as PRODUCTS
from engine.model.cpu.products import PackedWeight
from engine.model.platform import NONE, RMSNORM, SILU_MUL

FLAGS = cpu_flags()  # empty where /proc/cpuinfo has none
# x86-64-v3 needs these to run; x86-64 runs on any x86-64 CPU
TARGETS = {
    "x86-64-v3": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
    "x86-64": set(),
}


def _build(source_kind: str, march: str) -> ModuleType:
    if not FLAGS:
        pytest.skip("not an x86-64 Linux machine")
    if not TARGETS[march] <= FLAGS:
        pytest.skip(f"this CPU cannot run {march} code")
    tag = march.replace("-", "_")  # a module name
    source, prefix, selftest = (
        (PRODUCTS, "radixkv_dense", PRODUCTS_SELF_TEST)
        if source_kind == "products"
        else (exact_attention.SOURCE, "radixkv_exact", exact_attention.SELF_TEST)
    )
    module = native_build.load_native(
        source, f"{prefix}_{tag}", "nothing to compare", march, selftest=selftest
    )
    assert module is not None, f"the {source_kind} kernel did not build for {march}"
    return module


@pytest.fixture(scope="module")
def products() -> dict[str, ModuleType]:
    from engine.model.cpu.products import load_products

    native_kernel = load_products()
    assert native_kernel is not None
    return {"native": native_kernel, **{m: _build("products", m) for m in TARGETS}}


@pytest.fixture(scope="module")
def attention() -> dict[str, ModuleType]:
    native_kernel = exact_attention.load_kernel()
    assert native_kernel is not None
    return {"native": native_kernel, **{m: _build("attention", m) for m in TARGETS}}


def _product_outputs(kernel: ModuleType, dtype: torch.dtype, small: bool) -> list[torch.Tensor]:
    """The model's layer kinds (fused prologues, bias, residual) at odd sizes and row counts."""
    gen = torch.Generator().manual_seed(11)
    k, n = (40, 72) if small else (576, 960)  # 40: a 16-column step and a tail of 8
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    norm = torch.rand(k, generator=gen) + 0.5
    packed = PackedWeight(kernel, w, bias)
    down = PackedWeight(kernel, torch.randn(n, k, generator=gen).to(dtype))
    outs = []
    for m in (1, 3, 7, 13):
        x = torch.randn(m, k, generator=gen) * 3
        gu = torch.randn(m, 2 * k, generator=gen) * 4
        res = torch.randn(m, n, generator=gen)
        for threads in (1, 2):
            outs.append(packed(x, NONE, threads=threads))
            outs.append(packed(x, RMSNORM, norm, 1e-5, residual=res, threads=threads))
            outs.append(down(gu, SILU_MUL, residual=res, threads=threads))
    return outs


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs: max {float((x - y).abs().max())}"


def test_float32_products_are_the_same_bits_in_avx512_avx2_and_plain_builds(
    products: dict[str, ModuleType],
) -> None:
    _same(_product_outputs(products["native"], torch.float32, small=False),
          _product_outputs(products["x86-64-v3"], torch.float32, small=False))
    # the plain build's fma is the C library's, exact but slow: small shapes
    _same(_product_outputs(products["native"], torch.float32, small=True),
          _product_outputs(products["x86-64"], torch.float32, small=True))


def test_bfloat16_weights_widened_give_the_same_bits_in_avx2_and_plain_builds(
    products: dict[str, ModuleType],
) -> None:
    """(Where the native build has vdpbf16ps it takes another, faster path: not compared.)"""
    _same(_product_outputs(products["x86-64-v3"], torch.bfloat16, small=True),
          _product_outputs(products["x86-64"], torch.bfloat16, small=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_the_same_bits_in_avx512_avx2_and_plain_builds(
    attention: dict[str, ModuleType], dtype: torch.dtype
) -> None:
    """A prefill chunk after cached tokens, decodes on shared prefix pages and alone, through
    the fused RoPE + K/V write + attention call, at one thread and two."""
    hkv, group, dim, page_size = 3, 3, 64, 16
    gen = torch.Generator().manual_seed(5)
    cached, qo = [100, 70, 70, 0], [17, 1, 1, 1]
    lens = [c + n for c, n in zip(cached, qo)]
    pool_pages = 40
    k_pool = torch.randn(pool_pages, page_size, hkv, dim, generator=gen).to(dtype)
    v_pool = torch.randn(pool_pages, page_size, hkv, dim, generator=gen).to(dtype)
    free = random.Random(5).sample(range(pool_pages), pool_pages)
    shared = [free.pop() for _ in range(4)]  # requests 1 and 2 share their first 64 tokens
    tables = []
    for s, n in enumerate(lens):
        own = [free.pop() for _ in range(-(-n // page_size))]
        tables.append(shared + own[4:] if s in (1, 2) else own)
    slots = torch.tensor(
        [tables[s][p // page_size] * page_size + p % page_size
         for s in range(len(lens)) for p in range(cached[s], lens[s])],
        dtype=torch.int64,
    )
    positions = torch.tensor([p for s in range(len(lens)) for p in range(cached[s], lens[s])])
    qkv = torch.randn(len(slots), (hkv * group + 2 * hkv) * dim, generator=gen)
    angles = positions[:, None].float() * (10000.0 ** (-torch.arange(0, dim, 2).float() / dim))
    cos, sin = angles.cos(), angles.sin()
    plan = exact_attention.plan_native(qo, lens, tables, torch.device("cpu"))

    def run(kernel: ModuleType, threads: int) -> tuple[torch.Tensor, ...]:
        k, v = k_pool.clone(), v_pool.clone()
        out = exact_attention.rope_write_attend(
            kernel, qkv, cos, sin, slots, k, v, plan, group, dim**-0.5, threads
        )
        return out, k, v

    for threads in (1, 2):
        want = run(attention["native"], threads)
        for march in TARGETS:
            got = run(attention[march], threads)
            for name, a, b in zip(("out", "k", "v"), want, got):
                assert torch.equal(a, b), (march, threads, name)
