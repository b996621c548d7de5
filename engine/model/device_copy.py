"""Small host lists onto the model's device without waiting for it.

``torch.tensor(values, device=cuda)`` copies from pageable memory, synchronously: in a step's
sampling path it makes the host wait for the whole pass before it can queue the rest, a second
wait beside the step's one read-back. From pinned memory with ``non_blocking`` the copy is
queued behind the pass and the host goes on (torch's caching host allocator keeps the pinned
block until the copy has read it). Elsewhere it is a plain tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Where tensors made from Python values live.
HOST = torch.device("cpu")


def on_host(device: torch.device) -> bool:
    """Whether ``device``'s memory is the host's: a tensor made here needs no copy there."""
    return device.type == HOST.type


def on_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a 1-d ``dtype`` tensor on ``device``, queued rather than waited for."""
    return queued(torch.tensor(values, dtype=dtype), device)[1]


def queued(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``host`` (pinned) and its copy on ``device``, queued rather than waited for; on the
    host both are ``host``."""
    if on_host(device):
        return host, host
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)
