"""The paged KV cache tensors: one K and one V tensor per layer, indexed by radix page ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.model.device_copy import on_device


class KVPool:
    """K and V per layer as ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD layout).

    Page ids are those of the radix ``PageAllocator`` built with the same ``num_pages``: the
    pool never allocates, it only stores. A token's slot is ``page * page_size + offset``.
    ``scratch_pages`` more pages follow them, ids ``num_pages`` and up, never handed out: a
    decode graph's padding rows write their K/V there (``scratch_page``).

    A window-aware pool (``window_layers``) keeps those layers' K/V in ``window_pages`` window
    slots instead: a page's slot is ``window_map[page]`` (the KV manager's
    ``WindowSlots.slot_of``, attached with ``attach_window``; -1: none, its window-layer KV is
    gone). ``write``, ``copy_slots`` and the backends (``window_slots``, ``window_pages_of``)
    go through it for those layers.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        scratch_pages: int = 0,
        window_layers: Sequence[int] = (),
        window_pages: int = 0,
    ) -> None:
        if scratch_pages < 0:
            raise ValueError(f"scratch_pages: must be >= 0, got {scratch_pages}")
        if window_layers and (window_pages < 1 or scratch_pages):
            raise ValueError(
                "window_pages: a window-aware pool needs >= 1 window page and no scratch pages"
            )
        if any(not 0 <= layer < num_layers for layer in window_layers):
            raise ValueError(f"window_layers: {list(window_layers)} not all in 0..{num_layers - 1}")
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.scratch_pages = scratch_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.window_layers = frozenset(window_layers)
        self.window_pages = window_pages if window_layers else 0
        self.window_map: np.ndarray | None = None
        full = (num_pages + scratch_pages, page_size, num_kv_heads, head_dim)
        slots = (window_pages, page_size, num_kv_heads, head_dim)

        def layer_tensor(layer: int) -> torch.Tensor:
            shape = slots if layer in self.window_layers else full
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.k_cache = [layer_tensor(layer) for layer in range(num_layers)]
        self.v_cache = [layer_tensor(layer) for layer in range(num_layers)]

    # ------------------------------------------------------------------ window layers

    def attach_window(self, window_map: np.ndarray) -> None:
        """Read the window layers' pages through ``window_map`` (page -> slot, -1: none)."""
        if not self.window_layers:
            raise ValueError("window_map: this pool has no window layers")
        if window_map.shape != (self.num_pages,):
            raise ValueError(f"window_map: expected {self.num_pages} entries, got {window_map.shape}")
        self.window_map = window_map

    def is_window(self, layer: int) -> bool:
        return layer in self.window_layers

    def _map(self) -> torch.Tensor:
        if self.window_map is None:
            raise RuntimeError("KVPool: window layers used before attach_window")
        return torch.from_numpy(self.window_map).to(self.device)

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots -> window-layer slots; RuntimeError where a page has no window slot
        (a write there would land in another page's KV)."""
        p = self.page_size
        mapped = self._map()[slots // p]
        if bool((mapped < 0).any()):
            raise RuntimeError("KVPool: a token's page has no window slot")
        return mapped * p + slots % p

    def window_pages_of(self, pages: torch.Tensor) -> torch.Tensor:
        """Pool pages -> window slots, 0 where a page has none (``check_window`` has made
        sure no window layer reads those)."""
        return self._map()[pages.long()].clamp_min(0).to(pages.dtype)

    def check_window(
        self, kv_indptr: Sequence[int], kv_indices: torch.Tensor, query_starts: Sequence[int],
        window: int,
    ) -> None:
        """RuntimeError unless every page a window layer reads (each request's pages from its
        first query's window on) has a window slot: the guard of "exact or not taken"."""
        mapped = self.window_map
        if mapped is None:
            raise RuntimeError("KVPool: window layers used before attach_window")
        pages = kv_indices.cpu().numpy()
        p = self.page_size
        for r, start in enumerate(query_starts):
            first = kv_indptr[r] + max(0, start - window + 1) // p
            if (mapped[pages[first : kv_indptr[r + 1]]] < 0).any():
                raise RuntimeError(
                    f"KVPool: request {r} reads a page whose window-layer KV is gone"
                )

    @property
    def scratch_page(self) -> int | None:
        """The first page id no request owns (None without scratch pages)."""
        return self.num_pages if self.scratch_pages else None

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def pages_for_bytes(
        num_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many pages fit in ``num_bytes`` (K and V, all layers)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes: must be >= 0, got {num_bytes}")
        per_page = KVPool.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)
        return num_bytes // per_page

    @property
    def num_bytes(self) -> int:
        """K and V of every layer: the pool pages' and the window slots'."""
        return sum(t.numel() * t.element_size() for t in (*self.k_cache, *self.v_cache))

    def k_flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as ``[num_pages * page_size, num_kv_heads, head_dim]`` (a view)."""
        return self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        return self.v_cache[layer].view(-1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V ``[T, num_kv_heads, head_dim]`` at int64 ``slots`` ``[T]`` (pool
        slots: a window layer's go through its map)."""
        if layer in self.window_layers:
            slots = self.window_slots(slots)
        self.store(layer, slots, k, v)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` at slots of the layer's own space (a window layer's already mapped: a
        backend maps a pass's slots once, not per layer)."""
        self.k_flat(layer).index_copy_(0, slots, k.to(self.dtype))
        self.v_flat(layer).index_copy_(0, slots, v.to(self.dtype))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Every layer's K/V at slots ``src`` copied to slots ``dst`` (same length)."""
        if not src:
            return
        s = on_device(src, torch.int64, self.device)
        d = on_device(dst, torch.int64, self.device)
        if self.window_layers:
            ws, wd = self.window_slots(s), self.window_slots(d)
        for layer in range(self.num_layers):
            a, b = (ws, wd) if layer in self.window_layers else (s, d)
            for flat in (self.k_flat(layer), self.v_flat(layer)):
                flat.index_copy_(0, b, flat.index_select(0, a))

    # ------------------------------------------------------------------ pages as bytes

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page's K and V over all layers (a tier record's data)."""
        return self.bytes_per_page(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        """Each page's K and V of every layer as one bytes object (layer-major: K0 V0 K1 ...),
        bit for bit, on the host. Not for a window-aware pool (its tiers are off)."""
        if self.window_layers:
            raise RuntimeError("KVPool: a window-aware pool's pages are not whole")
        if not pages:
            return []
        index = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        parts = []
        for layer in range(self.num_layers):
            parts.append(self.k_cache[layer].index_select(0, index))
            parts.append(self.v_cache[layer].index_select(0, index))
        block = torch.stack(parts, dim=1).cpu()  # [n, 2 * layers, page, heads, dim]
        raw = block.reshape(len(pages), -1).view(torch.uint8).numpy()
        return [row.tobytes() for row in raw]

    def write_pages(self, pages: Sequence[int], data: Sequence[bytes]) -> None:
        """Store ``read_pages`` bytes into ``pages`` (the inverse of ``read_pages``)."""
        if self.window_layers:
            raise RuntimeError("KVPool: a window-aware pool's pages are not whole")
        if len(pages) != len(data):
            raise ValueError(f"data: expected {len(pages)} pages' bytes, got {len(data)}")
        if not pages:
            return
        size = self.page_nbytes
        for i, blob in enumerate(data):
            if len(blob) != size:
                raise ValueError(f"data[{i}]: expected {size} bytes, got {len(blob)}")
        buf = bytearray(b"".join(data))
        shape = (len(pages), 2 * self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)
        block = torch.frombuffer(buf, dtype=self.dtype).view(shape).to(self.device)
        index = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            self.k_cache[layer].index_copy_(0, index, block[:, 2 * layer])
            self.v_cache[layer].index_copy_(0, index, block[:, 2 * layer + 1])
