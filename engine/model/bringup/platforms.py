"""The platform a device runs: the one place that knows both ``engine.model.cpu`` and
``engine.model.cuda``.

A device's type picks its platform. An attention backend the device's own platform does not
run is run by the platform that has it, over the device's: FlashInfer asked for on a CPU is the
CUDA platform's path on that CPU (its torch reference: how CI tests the CUDA path), with the
CPU's products, threads and memory.
"""

from __future__ import annotations

import torch

from engine.config import BACKENDS
from engine.model.bringup.reference_platform import ReferencePlatform
from engine.model.cpu.platform import CpuPlatform
from engine.model.cpu.threads import ThreadPolicy
from engine.model.cuda.platform import CudaPlatform
from engine.model.platform import Platform


def device_platform(device: torch.device, threads: ThreadPolicy | None = None) -> Platform:
    """The platform of ``device``'s type (``threads``: the CPU's policy per pass); ValueError
    for a device radixkv does not run on, or CUDA where there is none."""
    if device.type == "cuda":
        return CudaPlatform(device)
    if device.type == "cpu":
        return CpuPlatform(device, threads)
    raise ValueError(f"device: unsupported device type {device.type!r} (cpu, cuda)")


def platform_for(
    device: torch.device, backend: str = "torch", threads: ThreadPolicy | None = None
) -> Platform:
    """The platform that runs attention ``backend`` (a name, ``"auto"`` resolved: see
    ``resolve_backend``) on ``device``."""
    own = device_platform(device, threads)
    if backend in own.backends:
        return own
    if backend in CudaPlatform.backends:
        return ReferencePlatform(own, CudaPlatform(device))
    raise ValueError(f"backend: unknown attention backend {backend!r}; available: "
                     f"{', '.join(BACKENDS)}")


def resolve_device(device: str | torch.device | None = "cpu") -> torch.device:
    """``None``/``"auto"`` picks CUDA when present, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: cannot parse {device!r} (cpu, cuda, cuda:N, auto)") from exc
    device_platform(dev)  # refuses a device type radixkv does not run on, or absent CUDA
    return dev


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto": the device's platform's choice (FlashInfer on CUDA where it is installed, the
    torch one otherwise: on the CPU the flashinfer backend is only its slow reference, for
    tests)."""
    if backend != "auto":
        return backend
    return device_platform(device).default_backend()
