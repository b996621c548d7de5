"""The model side of an engine, built from its ``EngineConfig``: the KV pool sized for this
machine and the runner with the attention backend it resolves to.

What is decided here depends on the loaded model and the machine (free memory, the dtype
probe's verdict), so it runs after the load; the config's own checks ran before it.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from engine.config import EngineConfig
from engine.model.cpu.machine import available_memory_bytes, machine_memory_bytes
from engine.model.cpu.probe import probe
from engine.model.cpu.threads import ThreadPolicy
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from engine.model.structured import Grammars

# Default KV budget on the CPU: 1 GiB (about 23k tokens of SmolLM2-135M in float32), or an
# eighth of the machine's memory when that is smaller. On CUDA: a share of the free memory
# after the weights are loaded.
CPU_KV_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.7


def build_pool(loaded: LoadedModel, config: EngineConfig) -> KVPool:
    """The KV pool: ``num_pages`` pages, or as many as ``kv_cache_bytes`` (or the default
    budget) holds; refused before allocating when the machine has not the memory for it."""
    cfg = loaded.config
    page_size = config.page_size
    per_page = KVPool.bytes_per_page(
        cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    pages = config.num_pages
    if pages is None:
        budget = config.kv_cache_bytes
        if budget is None:
            if loaded.device.type == "cuda":
                budget = KVPool.cuda_budget_bytes(CUDA_KV_FRACTION, loaded.device)
            else:
                budget = min(CPU_KV_BYTES, machine_memory_bytes() // 8)
        pages = KVPool.pages_for_bytes(
            budget, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
        )
        if pages < 1:
            raise ValueError(f"kv_cache_bytes: {budget} is less than one page ({per_page} bytes)")
    # A pool too large for the machine would get the process killed, not an error.
    need = pages * per_page
    if loaded.device.type == "cuda":
        available = torch.cuda.mem_get_info(loaded.device)[0]
    else:
        available = available_memory_bytes()
    if need > available:
        field = "num_pages" if config.num_pages else "kv_cache_bytes"
        raise ValueError(
            f"{field}: {pages} pages x {per_page:,} bytes (page_size {page_size}) = {need:,} "
            f"bytes of KV cache, more than the {available:,} bytes of memory available"
        )
    return KVPool(
        cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim,
        loaded.dtype, loaded.device, scratch_pages=1 if uses_graphs(loaded, config) else 0,
    )


def uses_graphs(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Decode graphs: asked for, on CUDA, with FlashInfer (the only backend with graph-mode
    wrappers)."""
    return (
        config.cuda_graphs
        and loaded.device.type == "cuda"
        and resolve_backend(config.backend, loaded.device) == "flashinfer"
    )


def build_runner(
    loaded: LoadedModel, pool: KVPool, config: EngineConfig, grammars: Grammars | None = None
) -> ModelRunner:
    """The runner over ``pool`` with the backend ``config.backend`` resolves to here, masking
    by ``grammars`` (structured outputs)."""
    return ModelRunner(
        loaded,
        pool,
        backend=resolve_backend(config.backend, loaded.device),
        threads=ThreadPolicy.default(config.threads),
        batch_invariant=config.batch_invariant,
        grammars=grammars,
        cuda_graphs=uses_graphs(loaded, config),
        max_batch=config.scheduler.max_running,
        max_verify_rows=verify_rows(config),
    )


def verify_rows(config: EngineConfig) -> int:
    """Rows of the largest verify pass the scheduler can make (0 without speculation): every
    running request with a full draft."""
    scheduler = config.scheduler
    if scheduler.speculation == "off":
        return 0
    return scheduler.max_running * (1 + scheduler.num_speculative_tokens)


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto": FlashInfer on CUDA where it is installed (the ``gpu`` extra), the torch one
    otherwise (on the CPU the flashinfer backend is only its slow reference, for tests)."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def verified_invariant(loaded: LoadedModel, asked: bool, runner: ModelRunner) -> bool:
    """Whether this machine's forward is verified batch-invariant: on the CPU by the dtype
    probe (``engine.model.cpu.probe``), on CUDA by checking ``runner`` itself at start
    (``engine.model.cuda.device_check``); warns when it was asked for and not verified."""
    if not asked:
        return False
    # The probe covers the CPU's own kernels; FlashInfer's path (its reference on the CPU) is
    # checked on the runner itself.
    if loaded.device.type != "cpu" or runner.backend.name == "flashinfer":
        from engine.model.cuda.device_check import verify_on_device

        return verify_on_device(runner)
    name = str(loaded.dtype).removeprefix("torch.")
    report = probe().reports.get(name)
    if report is not None and report.usable:
        return True
    why = "its probe crashed" if report is None else (
        f"not invariant ({', '.join(report.failed)})" if not report.invariant
        else f"{report.error:.2g} from float32"
    )
    warnings.warn(
        f"batch_invariant: the {name} forward was not verified on this CPU ({why}); "
        "greedy answers may depend on the batch and the cache",
        stacklevel=4,
    )
    return False


def warn_if_slow_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """float16 on a CPU has no fast kernels in torch (several times slower than float32):
    say so."""
    if device.type == "cpu" and dtype == torch.float16:
        warnings.warn(
            "dtype: float16 on the CPU runs several times slower than float32 (torch has no "
            "fast CPU kernels for it); use float32, bfloat16, or dtype=None to measure",
            RuntimeWarning,
            stacklevel=4,
        )
