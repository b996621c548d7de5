"""A model loaded for an engine: its device and dtype resolved (``auto`` included), then read by
the core's loader (``engine.model.loader``).

The device picks its platform; a dtype not asked for is the platform's default, or where it is
measured (the CPU) the one the dtype probe found fastest and verified on this machine. The
platform refuses a dtype that cannot run on it before any weight is read.
"""

from __future__ import annotations

import os

import torch

from engine.model.bringup.dtype_probe import probe
from engine.model.bringup.platforms import device_platform, resolve_device
from engine.model.loader import LoadedModel, load_on_device

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(
    dtype: str | torch.dtype | None, device: str | torch.device | None = "cpu"
) -> torch.dtype:
    """``None``/``"auto"``: the device's platform's default (bfloat16 on CUDA); on the CPU the
    faster of float32 and bfloat16 as measured on this machine (``dtype_probe``, remembered per
    CPU model and torch version)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: unsupported {dtype} (float32, bfloat16, float16)")
        return dtype
    if dtype is None or dtype == "auto":
        default = device_platform(resolve_device(device)).default_dtype()
        return default if default is not None else _DTYPES[probe().dtype]
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype: unsupported {dtype!r} (float32, bfloat16, float16, auto)")


def load_model(
    model: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load ``model`` (None: the bundled SmolLM2) as our LlamaModel on ``device``/``dtype``."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    device_platform(dev).check_dtype(dt)
    return load_on_device(model, dev, dt)
