"""What a device gives the model core: one interface, two platforms.

The core (the runner, the Llama forward, the loader, the pool) runs on any device and never
asks which one: what differs between devices is asked of its ``Platform``. ``engine.model.cpu``
provides the CPU's (our batch-invariant products and attention kernel, thread counts per pass,
the dtype measured per machine) and ``engine.model.cuda`` the GPU's (FlashInfer, one packed
copy per pass, decode graphs, the runner checked at start). The bring-up
(``engine.model.bringup``) chooses the platform for a device and is the one place that knows
both; the core only ever sees this interface.

The interface describes what both platforms answer; what only one of them knows (the CPU's
thread policy, FlashInfer's cascade rule) stays inside its folder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import msgspec
import torch

from engine.model.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch, IndexPacker, StepIndex
from engine.model.kv_pool import KVPool
from engine.model.model_config import ModelConfig

# What a packed product applies to each input row before the product (its kernel's codes):
# nothing, RMSNorm by a weight, or SiLU(gate) * up (GELU(gate) * up) over the row's two halves.
NONE, RMSNORM, SILU_MUL, GELU_MUL = 0, 1, 2, 3


class RowOps(Protocol):
    """Row transforms between packed products, each row computed alone (so batch-invariant
    where the products are): what some families need besides the products' own prologues."""

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
        """RMSNorm of each of ``heads`` equal segments of every float32 row of ``x`` by
        ``weight`` (one value per column), plus ``residual``; into ``x`` where ``in_place``."""
        ...

    def softcap_(self, x: torch.Tensor, cap: float, threads: int = 1) -> torch.Tensor:
        """``cap * tanh(x / cap)`` of every float32 element of ``x``, in place."""
        ...


class PackedProduct(Protocol):
    """A linear layer's weight ``[out, in]`` packed once for a platform's own products."""

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
        ...

    def path(self) -> str:
        """What computes the product (the kernel's code path), for stats and benchmarks."""
        ...


# Packs a weight ``[out, in]`` and its bias (or None) for the platform's products.
Packer = Callable[[torch.Tensor, torch.Tensor | None], PackedProduct]
# A planned pass's tensor work: (forward batch, backend) -> logits of its sampled rows.
PlannedForward = Callable[[ForwardBatch, AttentionBackend], torch.Tensor]
# A pass run eagerly, as without graphs: (index) -> logits of its sampled rows.
EagerPass = Callable[[StepIndex], torch.Tensor]


class GraphedPasses(Protocol):
    """Passes replayed from captured graphs (decode and verify steps), where one fits."""

    def shape_for(self, index: StepIndex) -> tuple[int, int] | None:
        """The graph (entries, rows) that holds ``index``; None: it runs eagerly."""
        ...

    def run(self, index: StepIndex, shape: tuple[int, int]) -> torch.Tensor:
        """Logits of the pass ``index`` in the graph ``shape_for(index)`` gave."""
        ...


class KVMemory(msgspec.Struct, frozen=True):
    """The memory a KV pool may take on a device: its default budget (when the config names
    none) and what is free now (a pool larger than that is refused, not allocated)."""

    default_bytes: int
    available_bytes: int


class Platform(ABC):
    """What a device provides to the model core. One per engine (it holds the engine's thread
    policy); made by the bring-up for the engine's device and attention backend."""

    device: torch.device
    #: The attention backends it runs, by ``EngineConfig.backend`` name.
    backends: tuple[str, ...]
    #: Whether the vendor's matrix products (torch's) give a row the same bits whatever else
    #: shares the call: cuBLAS's measured so (the start-up check verifies it); a CPU BLAS's
    #: are not, so the CPU runs its own products instead.
    torch_products_invariant: bool
    #: How the passes' batch invariance is verified: by checking the engine's own runner at
    #: start (True: FlashInfer's plan and cuBLAS depend on the device, the libraries and the
    #: shapes), or by the dtype probe, which ran the real forward once per machine (False).
    verifies_runner: bool

    # ------------------------------------------------------------------------ the forward

    @abstractmethod
    def default_backend(self) -> str:
        """The attention backend ``"auto"`` means here."""

    @abstractmethod
    def attention_backend(
        self, name: str, config: ModelConfig, exact: bool, threads: int, dtype: torch.dtype
    ) -> AttentionBackend:
        """The backend called ``name`` for a model of ``config`` with activations and KV in
        ``dtype``: with ``exact`` a batch-invariant one where the platform has it (on
        ``threads`` threads), else its fastest. ValueError for a name it does not run."""

    @abstractmethod
    def packer(self, dtype: torch.dtype) -> Packer | None:
        """How the platform packs a linear layer's weight for its own products in ``dtype``;
        None: torch's products run (the model's weights as they are)."""

    def row_ops(self) -> RowOps | None:
        """The row transforms that go with ``packer``'s products (None where there is none)."""
        return None

    @property
    @abstractmethod
    def product_threads(self) -> int:
        """Threads our products and attention kernel split each call over."""

    @abstractmethod
    def pass_threads(self, num_tokens: int) -> None:
        """Set the calling thread's intra-op threads for a pass of ``num_tokens`` tokens."""

    @abstractmethod
    def step_buffers(self) -> IndexPacker | None:
        """What moves a pass's integers to the device in one copy (None: plain tensors)."""

    @abstractmethod
    def decode_graphs(
        self,
        backend: AttentionBackend,
        pool: KVPool,
        forward: PlannedForward,
        eager: EagerPass | None,
        max_batch: int,
        max_pages_per_entry: int,
        max_rows: int,
    ) -> GraphedPasses:
        """Decode passes of up to ``max_batch`` entries (and verify passes of up to
        ``max_rows`` rows) replayed from graphs over ``backend``; ``eager`` checks each
        graph's first replay. ValueError where the platform or the backend has none."""

    @property
    @abstractmethod
    def captures_graphs(self) -> bool:
        """Whether its decode graphs are captured (a GPU's; elsewhere they run uncaptured,
        for tests, and an engine does not build them)."""

    # --------------------------------------------------------------------- the engine loop

    @abstractmethod
    def on_loop_start(self) -> None:
        """Called by the thread that built the engine as its loop starts."""

    @abstractmethod
    def on_loop_idle(self) -> None:
        """Called by the loop thread when it has nothing to run."""

    @abstractmethod
    def release_cached_memory(self) -> None:
        """Hand memory a device allocator keeps cached back to the device (dropped graphs, a
        closed engine's pool)."""

    # --------------------------------------------------------------------------- the KV

    @abstractmethod
    def kv_memory(self) -> KVMemory:
        """What a KV pool may take now (call after the weights are loaded)."""

    @abstractmethod
    def kv_identity(self, products: str | None) -> str:
        """What KV computed here depends on besides the model, dtype and layout (the disk
        tier keys its store by it): the device and the kernels. ``products``: the model's
        packed products' path (None: torch's)."""

    # ---------------------------------------------------------------- dtype and start-up

    @abstractmethod
    def default_dtype(self) -> torch.dtype | None:
        """The dtype an engine runs in when none is asked for; None: measured per machine
        (the bring-up's dtype probe)."""

    @abstractmethod
    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError where ``dtype`` cannot run on this device."""

    @abstractmethod
    def dtype_warning(self, dtype: torch.dtype) -> str | None:
        """Why ``dtype`` runs slowly here (the engine warns with it), or None."""
