"""The platform a device runs: the CPU's own on a CPU, FlashInfer asked for on a CPU is the CUDA
platform's path over the CPU's products, threads and memory (how CI runs it), and a backend or
device radixkv does not run is refused by name."""

from __future__ import annotations

import pytest
import torch

from engine.model.bringup.platforms import device_platform, platform_for, resolve_backend
from engine.model.cpu.kernels import kernels_key
from engine.model.cpu.machine import machine_key
from engine.model.cpu.platform import CpuPlatform
from engine.model.cpu.products import load_products
from engine.model.cpu.threads import ThreadPolicy
from engine.model.cuda.flashinfer_backend import FlashInferBackend
from engine.model.model_config import ModelConfig

CPU = torch.device("cpu")
CONFIG = ModelConfig("llama", 10, 32, 1, 2, 1, 32, 64, 1e-5, 1e4, None, 64, True, False)


def test_a_cpu_runs_the_cpu_platform_with_its_thread_policy() -> None:
    platform = platform_for(CPU, "torch", ThreadPolicy(3))
    assert isinstance(platform, CpuPlatform)
    assert platform.product_threads == 3 and not platform.verifies_runner
    assert platform_for(CPU).product_threads == 1  # no policy: our kernels on one thread
    assert resolve_backend("auto", CPU) == "torch"
    assert platform.step_buffers() is None and not platform.captures_graphs


def test_flashinfer_on_a_cpu_is_the_cuda_path_over_the_cpus_products_and_memory() -> None:
    platform = platform_for(CPU, "flashinfer", ThreadPolicy(2))
    backend = platform.attention_backend("flashinfer", CONFIG, True, 2, torch.float32)
    assert isinstance(backend, FlashInferBackend)
    assert backend.kernel_name == "flashinfer-reference" and backend.deterministic
    # the runner itself is checked at start, as on a GPU; nothing is captured on a CPU
    assert platform.verifies_runner and not platform.captures_graphs
    # the CPU's side: threads, one-copy packing not needed, products, KV identity, dtype
    cpu = device_platform(CPU, ThreadPolicy(2))
    assert platform.product_threads == 2 and platform.step_buffers() is None
    assert (platform.packer(torch.float32) is None) == (load_products() is None)
    assert platform.kv_identity(None) == cpu.kv_identity(None)
    assert platform.default_dtype() is None  # measured, as on the CPU
    assert platform.dtype_warning(torch.float16) == cpu.dtype_warning(torch.float16)


def test_the_cpu_keys_its_kv_by_the_machine_and_the_kernels() -> None:
    """The disk tier's store key: the same text as before the platforms took it over."""
    cpu = device_platform(CPU)
    assert cpu.kv_identity(None) == f"cpu-{machine_key()}-{kernels_key()}-torch"
    assert cpu.kv_identity("avx512") == f"cpu-{machine_key()}-{kernels_key()}-avx512"


def test_a_backend_or_device_radixkv_does_not_run_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="backend: unknown attention backend 'cuda-magic'"):
        platform_for(CPU, "cuda-magic")
    with pytest.raises(ValueError, match="flashinfer"):
        CpuPlatform(CPU).attention_backend("flashinfer", CONFIG, False, 1, torch.float32)
    with pytest.raises(ValueError, match="unsupported device type 'meta'"):
        device_platform(torch.device("meta"))
