"""Every integer a pass needs, packed on the host into one buffer and copied to the device once.

Made tensor by tensor, a pass's index (token ids, positions, slots, page tables, FlashInfer's
append arguments, the rows to sample) was eight host-to-device copies per step, each a driver
call and a small transfer on the step's critical path. Here the host side is written into one
pinned buffer (numpy views: no torch op per field), one ``copy_`` moves the used span, and the
fields are views of the device buffer.

Two layouts: *compact* (each field right after the last one, sized to this pass; the buffers
grow when a pass needs more) for eager passes, and *fixed* (each field at an offset sized for
``capacity``) for the decode graphs, whose captured kernels read the same addresses at every
replay. Either way the page list comes last, so the copy stops where its used part ends.

The host side is two buffers used in turn: FlashInfer's ``plan`` copies the host views of a
pass's tables to the device asynchronously after that pass's own copy, so the buffer a pass
was packed in is rewritten only two passes later, once the copy of the pass in between has
completed (everything of the earlier pass was queued before it on the stream).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.model.forward_batch import INDEX_FIELDS

_ALIGN = 8  # bytes: every field starts on a boundary its dtype (at most 8 bytes) can view


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StepBuffers:
    """A pinned host buffer and a device buffer for the fields of ``INDEX_FIELDS`` (the CUDA
    platform's ``IndexPacker``).

    ``capacity`` (elements per field) fixes the layout; without it each ``pack`` lays the
    fields out compactly. ``copies`` counts host-to-device copies (one per ``pack``)."""

    def __init__(
        self, device: str | torch.device, capacity: Mapping[str, int] | None = None
    ) -> None:
        self.device = torch.device(device)
        self.capacity = dict(capacity) if capacity is not None else None
        self.copies = 0
        self._hosts = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self._turn = 0  # the host buffer of the last pack
        self._device = torch.empty(0, dtype=torch.uint8, device=self.device)
        # The last copy's completion: once it is done, every read of the other host buffer
        # (queued before it) is done, and that buffer may be rewritten.
        self._copied: torch.cuda.Event | None = None
        if self.capacity is not None:
            missing = [name for name, _ in INDEX_FIELDS if name not in self.capacity]
            if missing:
                raise ValueError(f"capacity: no size for {', '.join(missing)}")
            self._grow(self._offsets(self.capacity)[-1])

    def _offsets(self, sizes: Mapping[str, int]) -> list[int]:
        """Each field's byte offset, then the end of the last one."""
        offsets = [0]
        for name, dtype in INDEX_FIELDS:
            offsets.append(_aligned(offsets[-1] + sizes[name] * _itemsize(dtype)))
        return offsets

    def _grow(self, nbytes: int) -> None:
        if nbytes <= self._device.numel():
            return
        nbytes = max(nbytes, 2 * self._device.numel())
        # Pinned memory makes the copy asynchronous and one DMA; it only exists with CUDA.
        # (torch's pinned allocator keeps a replaced buffer until its pending copies are done.)
        pin = self.device.type == "cuda"
        self._hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pack(
        self, values: Mapping[str, Sequence[int]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``values`` written on the host and copied to the device once: (device views, host
        views), each field as long as its values. Raises ValueError past a fixed capacity."""
        if self._copied is not None:
            self._copied.synchronize()
        sizes = {name: len(values[name]) for name, _ in INDEX_FIELDS}
        if self.capacity is not None:
            over = [f"{n} ({sizes[n]} > {self.capacity[n]})" for n in sizes
                    if sizes[n] > self.capacity[n]]
            if over:
                raise ValueError(f"capacity: the pass exceeds the fixed layout: {', '.join(over)}")
            offsets = self._offsets(self.capacity)
        else:
            offsets = self._offsets(sizes)
            self._grow(offsets[-1])
        self._turn = 1 - self._turn
        host = self._hosts[self._turn]
        host_bytes = host.numpy()
        on_device: dict[str, torch.Tensor] = {}
        on_host: dict[str, torch.Tensor] = {}
        end = 0
        for (name, dtype), start in zip(INDEX_FIELDS, offsets):
            n = sizes[name]
            width = _itemsize(dtype)
            stop = start + n * width
            np_dtype = np.int64 if dtype == torch.int64 else np.int32
            host_bytes[start:stop].view(np_dtype)[:] = values[name]
            on_host[name] = host[start:stop].view(dtype)
            on_device[name] = self._device[start:stop].view(dtype)
            end = max(end, stop)
        if end:
            cuda = self.device.type == "cuda"
            self._device[:end].copy_(host[:end], non_blocking=cuda)
            if cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self.copies += 1
        return on_device, on_host
