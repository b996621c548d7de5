"""Our batch-invariant matrix products (``csrc/dense.cpp``): the linear layers and LM head.

A vendor BLAS picks kernels, blocking and packing by the machine, the row count and the thread
split, so a token's activations could depend on what else shares its pass (seen: oneDNN's
AVX-512 bf16 path on a Zen 4 EPYC, at shapes a probe of plain products never hit). Our kernel
sums every output element in one fixed order whatever the shape of the call (see the source's
header), so a row's result depends on that row and the weights alone. A build is used only
where its self-test shows a bad argument surfacing as a RuntimeError. Weights are packed once
into the layout the kernel streams (``PackedWeight``); RMSNorm, SiLU * up, the bias and the
residual add are fused around the product, so a decoder layer is a few native calls.

Where the build has the AMX tile path (``csrc/tiles.h``: Sapphire Rapids and later), bfloat16
weights are packed for the tiles instead, once a child process has seen the tiles granted,
accurate and batch-invariant on this machine (``tiles_keep_their_contract``); a VM that
advertises AMX and faults keeps the AVX-512 path, with a warning.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from engine.model.cpu.native_build import expect_rejection, load_native, self_test
from engine.model.platform import NONE

SOURCE = Path(__file__).parent / "csrc" / "dense.cpp"
DISABLE_ENV = "RADIXKV_NATIVE_PRODUCTS"  # "0" keeps torch's matrix products
TILES_ENV = "RADIXKV_AMX"  # "0" keeps bfloat16 products off the AMX tiles
SELF_TEST = "engine.model.cpu.products:rejects_a_weight_that_does_not_fit"
TILES_SELF_TEST = "engine.model.cpu.products:tiles_keep_their_contract"
# Shapes the tile test checks (K, N): SmolLM2's fused qkv and down products, and odd sizes.
TILE_TEST_SHAPES = ((576, 960), (1536, 576), (40, 70))
TILE_TEST_ROWS = 200


def load_products() -> ModuleType | None:
    """The compiled products (built on first use), or None where they cannot be built here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return load_native(
        SOURCE, "radixkv_dense", "using torch's matrix products", selftest=SELF_TEST
    )


def rejects_a_weight_that_does_not_fit(kernel: ModuleType) -> str | None:
    """The build's self-test (``native_build.self_test``): an input wider than the packed
    weight, on as many threads as the machine has cores, must raise RuntimeError. None where
    it did, else what happened."""
    packed = kernel.pack(torch.zeros(32, 32))
    threads = max(2, min(os.cpu_count() or 1, 64))
    return expect_rejection(
        lambda: kernel.dense(torch.zeros(1, 33), packed, 32, NONE, None, 0.0, None, None, threads),
        "features",
    )


def tiles_keep_their_contract(kernel: ModuleType) -> str | None:
    """The tile path's self-test (run first in a child: a VM whose AMX faults kills only the
    child): the registers granted, products within float32 rounding of a float64 reference
    (of x rounded to bfloat16, as the path rounds it), and each row's bits the same in calls
    of 1 to 200 rows and on one thread or two. None where all held, else what did not."""
    if not kernel.tiles_built():
        return "this build has no AMX tile path (the compiler's target has no amx_bf16)"
    if not kernel.request_tiles():
        return "Linux did not grant the AMX tile registers (arch_prctl refused)"
    gen = torch.Generator().manual_seed(0)
    for k, n in TILE_TEST_SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed = kernel.pack_tiles(w)
        x = torch.randn(TILE_TEST_ROWS, k, generator=gen)
        full = kernel.dense(x, packed, n, NONE, None, 0.0, None, None, 2)
        want = x.bfloat16().double() @ w.double().T
        error = (full.double() - want).abs().max().item()
        if error > 1e-5 * k**0.5 * want.abs().max().item():
            return f"a [{TILE_TEST_ROWS}, {k}] x [{k}, {n}] product is {error:.3g} off"
        for rows in (1, 5, 16, 17, 33, 199):
            for start in (0, TILE_TEST_ROWS - rows):
                part = kernel.dense(
                    x[start : start + rows], packed, n, NONE, None, 0.0, None, None, 1
                )
                if not torch.equal(part, full[start : start + rows]):
                    return f"rows {start}..{start + rows} differ alone and in {TILE_TEST_ROWS}"
    return None


@functools.cache
def tiles_usable(kernel: ModuleType) -> bool:
    """Whether bfloat16 weights go on the AMX tiles in this process: a build that has them, not
    switched off (RADIXKV_AMX=0), whose self-test passed here (the grant is per process)."""
    if os.environ.get(TILES_ENV, "1") == "0" or not kernel.tiles_built():
        return False
    why = self_test(kernel, Path(kernel.__file__), TILES_SELF_TEST)
    if why is not None:
        warnings.warn(
            f"AMX tiles failed their self-test on this machine ({why}); bfloat16 products "
            "keep the AVX-512 path",
            RuntimeWarning,
            stacklevel=2,
        )
    return why is None


class PackedWeight:
    """A linear layer's weight ``[out, in]`` packed for the kernel, with its bias (float32): the
    CPU's ``platform.PackedProduct``; the prologues are the platform's codes (``RMSNORM``...).
    ``tiles``: a bfloat16 weight goes on the AMX tiles (``tiles_usable``)."""

    def __init__(
        self,
        kernel: ModuleType,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        tiles: bool = False,
    ) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.tiles = tiles and weight.dtype == torch.bfloat16
        weight = weight.detach().contiguous()
        self.data = kernel.pack_tiles(weight) if self.tiles else kernel.pack(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        prologue: int = NONE,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        threads: int = 1,
    ) -> torch.Tensor:
        """``prologue(x) @ W^T (+ bias) (+ residual)`` in float32, ``[rows, out]``."""
        return self.kernel.dense(
            x, self.data, self.out_features, prologue, norm_weight, eps, self.bias, residual,
            threads,
        )

    def path(self) -> str:
        return "amx-tiles/bf16" if self.tiles else str(self.kernel.path_name())


class NativeRowOps:
    """The CPU's ``platform.RowOps``: the products' row transforms as calls of their own
    (``csrc/dense.cpp``), each row in one fixed order whatever the call's shape."""

    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        heads: int = 1,
        residual: torch.Tensor | None = None,
        in_place: bool = False,
        threads: int = 1,
    ) -> torch.Tensor:
        return self.kernel.rms_norm(x, weight, eps, heads, residual, in_place, threads)

    def softcap_(self, x: torch.Tensor, cap: float, threads: int = 1) -> torch.Tensor:
        return self.kernel.softcap_(x, cap, threads)
