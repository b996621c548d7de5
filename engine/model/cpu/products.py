"""Our batch-invariant matrix products (``csrc/dense.cpp``): the linear layers and LM head.

A vendor BLAS picks kernels, blocking and packing by the machine, the row count and the thread
split, so a token's activations could depend on what else shares its pass (seen: oneDNN's
AVX-512 bf16 path on a Zen 4 EPYC, at shapes a probe of plain products never hit). Our kernel
sums every output element in one fixed order whatever the shape of the call (see the source's
header), so a row's result depends on that row and the weights alone. A build is used only
where its self-test shows a bad argument surfacing as a RuntimeError. Weights are packed once
into the layout the kernel streams (``PackedWeight``); RMSNorm, SiLU * up, the bias and the
residual add are fused around the product, so a decoder layer is a few native calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

from engine.model.cpu.native_build import expect_rejection, load_native
from engine.model.platform import NONE

SOURCE = Path(__file__).parent / "csrc" / "dense.cpp"
DISABLE_ENV = "RADIXKV_NATIVE_PRODUCTS"  # "0" keeps torch's matrix products
SELF_TEST = "engine.model.cpu.products:rejects_a_weight_that_does_not_fit"


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


class PackedWeight:
    """A linear layer's weight ``[out, in]`` packed for the kernel, with its bias (float32): the
    CPU's ``platform.PackedProduct``; the prologues are the platform's codes (``RMSNORM``...)."""

    def __init__(
        self, kernel: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.data = kernel.pack(weight.detach().contiguous())
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
        return str(self.kernel.path_name())
