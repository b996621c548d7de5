"""The attention backend interface: plan once per forward pass, run once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.model_config import LayerAttention
from engine.model.rope import Rope, apply_rope_


@dataclass(frozen=True, eq=False)
class WindowIndex:
    """One pass's indices in a window-aware pool's window slots (``KVPool.window_map``)."""

    forward_batch: ForwardBatch
    slots: torch.Tensor  # int64, each new token's window slot
    kv_indices: torch.Tensor  # int32, each request's pages as window slots (0: not read)


class AttentionBackend(ABC):
    """Paged attention over a ragged batch.

    ``plan`` turns a ForwardBatch into whatever index/mask state the kernels need, once per
    forward pass; ``run`` is called per layer with that layer's new q/k/v, writes k/v into the
    pool at ``forward_batch.slots`` and returns the attention output for the new tokens.
    ``run_qkv`` starts one step earlier, from the fused projection's rows before RoPE, so a
    backend with a fused kernel does RoPE, the write and attention in one call.

    ``layers``: each layer's variant (score scale, soft cap, sliding window) where a model
    has them (``ModelConfig.attention_layers``); None: plain attention at head_dim ** -0.5.
    A backend that cannot run a variant refuses it at construction (``supports``).
    """

    name: str = "base"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        layers: Sequence[LayerAttention] | None = None,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.plain = LayerAttention(head_dim**-0.5)
        self.layers = tuple(layers) if layers is not None else None
        self._window_index: WindowIndex | None = None
        if self.layers is not None:
            unsupported = [a for a in self.layers if not self.supports(a)]
            if unsupported:
                raise ValueError(
                    f"model: its attention ({unsupported[0]}) does not run on the "
                    f"{self.name!r} attention backend"
                )

    def window_index(self, pool: KVPool, fb: ForwardBatch) -> WindowIndex:
        """``fb``'s slots and pages in ``pool``'s window slots (a window-aware pool), made
        once per pass, after checking every page a window layer will read still has its
        KV."""
        cached = self._window_index
        if cached is not None and cached.forward_batch is fb:
            return cached
        widest = max((a.window for a in self.layers or ()), default=0)
        indptr = fb.kv_indptr.tolist()
        starts = [kv - q for q, kv in zip(fb.qo_lens, fb.kv_lens)]
        pool.check_window(indptr, fb.kv_indices, starts, widest)
        index = WindowIndex(fb, pool.window_slots(fb.slots), pool.window_pages_of(fb.kv_indices))
        self._window_index = index
        return index

    def supports(self, attention: LayerAttention) -> bool:
        """Whether this backend runs ``attention`` (every backend runs plain attention)."""
        return attention == self.plain

    def layer(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention variant."""
        return self.plain if self.layers is None else self.layers[layer]

    @property
    def kernel_name(self) -> str:
        """What computes attention, for stats and benchmarks."""
        return "fast"

    @property
    def exact(self) -> bool:
        """True when a query's output never depends on what else shares the pass."""
        return False

    @abstractmethod
    def plan(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads, head_dim]`` -> ``[T, num_heads, head_dim]``."""

    def run_qkv(self, layer: int, qkv: torch.Tensor, rope: Rope, pool: KVPool) -> torch.Tensor:
        """Rows ``[T, (num_heads + 2 num_kv_heads) * head_dim]`` (q heads, k heads, v heads)
        -> ``[T, num_heads * head_dim]``: RoPE on q and k, then ``run``."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k sit side by side in each row: rotate both heads' sets in one pass.
        qk = qkv[:, : (hq + hkv) * d].unflatten(-1, (hq + hkv, d))
        apply_rope_(qk, *rope)
        v = qkv[:, (hq + hkv) * d :].unflatten(-1, (hkv, d))
        return self.run(layer, qk[:, :hq], qk[:, hq:], v, pool).reshape(-1, hq * d)
