"""Every knob of one engine, as one frozen record checked once: ``EngineConfig``.

The Python API (``Engine(config, **overrides)``), the three commands (``radixkv chat``,
``generate``, ``serve``, and ``serve --replicas``, which ships the record to each replica) and
the benchmarks all build this one record; the command-line flags are made from its fields
(``add_arguments`` / ``from_args``), so a new knob is a field here and nowhere else. It imports
neither torch nor the model: a front end or a router can read it without them.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from scheduler import POLICIES, SCHEDULING_POLICIES, SPECULATION, SchedulerConfig

BACKENDS = ("torch", "flashinfer")  # attention backends by name ("auto" picks one)
DTYPES = ("float32", "bfloat16", "float16")


# Without kv_disk_bytes the disk tier may take this much of its folder's free space at start,
# at most DISK_CAP_BYTES (all replicas of a cluster together: cluster/disk_slots.py).
DISK_FREE_FRACTION = 0.5
DISK_CAP_BYTES = 16 << 30


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one engine is built. ``scheduler`` holds the scheduler's knobs (page size, batch
    limits, policy, prefix caching, tuning); ``Engine(page_size=32)`` and the flags reach them
    by their plain names (``EngineConfig.make``).

    ``model``: None (the bundled SmolLM2-135M-Instruct), a HF Llama-family checkpoint
    directory or a .gguf file. The KV pool holds ``num_pages`` pages, or as many as fit in
    ``kv_cache_bytes`` (default: 1 GiB or an eighth of the memory on the CPU, a share of the
    free memory on CUDA). Below it, evicted pages go to host memory (``kv_host_bytes``) and
    page files in ``kv_disk_dir`` (within ``kv_disk_bytes``: default half the free space, at
    most 16 GiB), and to a remote store every engine of the model shares (``kv_remote``:
    ``redis://[:password@]host:port/db`` or ``rediss://``). A model with sliding-window layers keeps their KV only near each
    sequence's end, in ``window_kv_fraction`` window slots per pool page (``radix.window``;
    0: every page keeps every layer; off with KV tiers). Pins (``Engine.pin``, stored
    conversations) keep at most
    ``max_pinned_fraction`` of the pool. On the CPU, prefill-sized passes run on ``threads`` threads (None: every
    core) and decode steps on one. ``batch_invariant`` (the CPU's default) makes greedy answers
    independent of the batch, the cache and the page size (on CUDA: FlashInfer's
    deterministic plan, verified on the device at start). ``cuda_graphs``: decode steps replay
    CUDA graphs (CUDA with FlashInfer only; nothing changes on the CPU). ``dtype=None`` picks
    the faster of float32 and bfloat16 as measured on this CPU.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    backend: str = "auto"
    threads: int | None = None
    batch_invariant: bool = True
    cuda_graphs: bool = True
    kv_host_bytes: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = None
    kv_remote: str | None = None
    max_pinned_fraction: float = 0.5
    window_kv_fraction: float = 0.25
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self) -> None:
        _check_model(self.model)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device: expected cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.dtype is not None and self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype: unsupported {self.dtype!r} (float32, bfloat16, float16, auto)")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError("num_pages, kv_cache_bytes: give at most one of them")
        _optional_int("num_pages", self.num_pages, 1)
        _optional_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(
                f"backend: unknown {self.backend!r}; available: auto, {', '.join(BACKENDS)}"
            )
        _optional_int("threads", self.threads, 1)
        for flag in ("batch_invariant", "cuda_graphs"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: must be a bool, got {getattr(self, flag)!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(
                f"scheduler: expected a SchedulerConfig, got {type(self.scheduler).__name__}"
            )
        self._check_tiers()
        f = self.max_pinned_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise ValueError(f"max_pinned_fraction: must be a number in [0, 1], got {f!r}")
        w = self.window_kv_fraction
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0.0 <= w <= 1.0:
            raise ValueError(f"window_kv_fraction: must be a number in [0, 1], got {w!r}")

    def _check_tiers(self) -> None:
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(f"{name}: must be an int >= 0 (bytes), got {value!r}")
        directory = self.kv_disk_dir
        if directory is not None and not isinstance(directory, str):
            raise ValueError(f"kv_disk_dir: must be a path, got {type(directory).__name__}")
        if directory is not None and not directory:
            raise ValueError("kv_disk_dir: must be a non-empty path")
        if self.kv_disk_bytes is not None and directory is None:
            raise ValueError("kv_disk_bytes: needs kv_disk_dir (where the pages go)")
        remote = self.kv_remote
        if remote is not None and (
            not isinstance(remote, str)
            or urlsplit(remote).scheme not in ("redis", "rediss")
            or not urlsplit(remote).hostname
        ):
            raise ValueError(
                "kv_remote: expected redis://[:password@]host:port/db or rediss://..., "
                f"got {remote!r}"
            )
        if self.tiered and not self.scheduler.prefix_cache:
            raise ValueError(
                "kv_host_bytes, kv_disk_dir, kv_remote: KV tiers need prefix_cache=True "
                "(nothing is cached)"
            )
        if directory is not None:
            path = Path(directory).expanduser()
            if path.exists() and not path.is_dir():
                raise ValueError(f"kv_disk_dir: {directory!r} exists and is not a directory")

    # ------------------------------------------------------------------ the scheduler's knobs

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size

    @property
    def prefix_cache(self) -> bool:
        return self.scheduler.prefix_cache

    def disk_budget(self, directory: Path) -> int:
        """The disk tier's budget in ``directory``: ``kv_disk_bytes``, or the default (a share
        of its free space now, at most ``DISK_CAP_BYTES``)."""
        if self.kv_disk_bytes is not None:
            return self.kv_disk_bytes
        free = shutil.disk_usage(directory).free
        return min(DISK_CAP_BYTES, int(free * DISK_FREE_FRACTION))

    @property
    def tiered(self) -> bool:
        """Whether any KV tier below the pool is asked for."""
        return bool(self.kv_host_bytes) or self.kv_disk_dir is not None or bool(self.kv_remote)

    # -------------------------------------------------------------------------- building

    @classmethod
    def make(cls, **knobs: Any) -> EngineConfig:
        """A config from plain knob names, the scheduler's included (``page_size=32``,
        ``max_running=8``); ValueError names an unknown one."""
        return cls().replace(**knobs)

    def replace(self, **knobs: Any) -> EngineConfig:
        """This config with ``knobs`` changed (plain names, as ``make``), checked again."""
        own: dict[str, Any] = {}
        scheduler: dict[str, Any] = {}
        for name, value in knobs.items():
            if name in SCHEDULER_KNOBS:
                scheduler[name] = value
            elif name in ENGINE_KNOBS:
                own[name] = _plain(name, value)
            else:
                raise ValueError(
                    f"{name}: not an Engine or SchedulerConfig option; options: "
                    f"{', '.join(sorted(ENGINE_KNOBS + SCHEDULER_KNOBS))}"
                )
        if scheduler:
            own["scheduler"] = msgspec.structs.replace(self.scheduler, **scheduler)
        return msgspec.structs.replace(self, **own)

    def knobs(self) -> dict[str, Any]:
        """Every knob by its plain name (what ``make`` takes back)."""
        values = {name: getattr(self, name) for name in ENGINE_KNOBS}
        values.update(msgspec.structs.asdict(self.scheduler))
        return values

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The engine's flags: every command that builds an engine has these same ones."""
        add_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **defaults: Any) -> EngineConfig:
        """The config the flags of ``add_arguments`` describe (``defaults`` where a flag was
        not given); ValueError names the knob (``page_size``, not ``--page-size``)."""
        return from_args(args, **defaults)


ENGINE_KNOBS = tuple(f for f in EngineConfig.__struct_fields__ if f != "scheduler")
SCHEDULER_KNOBS = SchedulerConfig.__struct_fields__


def _plain(name: str, value: Any) -> Any:
    """Paths as str and torch dtypes by name, so the record stays plain data (it travels to
    replicas and into cache keys)."""
    if name in ("model", "kv_disk_dir") and isinstance(value, os.PathLike):
        return os.fspath(value)
    if name == "dtype" and value is not None and not isinstance(value, str):
        text = str(value)
        return text.removeprefix("torch.") if text.startswith("torch.") else value
    return value


def _check_model(model: Any) -> None:
    if model is None:
        return
    if not isinstance(model, str):
        raise ValueError(
            f"model: expected a checkpoint directory or .gguf path (str), got "
            f"{type(model).__name__}"
        )
    if not model:
        raise ValueError("model: empty path; pass None for the bundled model")


def _optional_int(name: str, value: Any, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")


# ----------------------------------------------------------------------------- the flags

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """``123``, ``512M``, ``2G``, ``1.5GiB`` -> bytes (powers of 1024)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _UNITS.get(value[-1:], 1)
    if scale > 1:
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (must be >= 0)")
    return int(number * scale)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (every command that builds an engine has the same ones); their
    defaults are None, so ``from_args`` changes only what was given."""
    group = parser.add_argument_group("engine")
    add = group.add_argument
    add("--model", help="HF Llama-family checkpoint directory or .gguf file (default: bundled "
        "SmolLM2-135M)")
    add("--device", help="cpu, cuda, cuda:N or auto (default)")
    add("--dtype", help="float32, bfloat16 or float16 (slow on a CPU); default: measured on "
        "this machine")
    add("--page-size", type=int, metavar="N", help="tokens per KV page (default 16)")
    add("--num-pages", type=int, metavar="N", help="KV cache size in pages")
    add("--kv-cache-bytes", type=byte_size, metavar="SIZE",
        help="KV cache size in bytes, e.g. 2G (default: 1G or an eighth of the memory on a CPU)")
    add("--max-running", type=int, metavar="N", help="requests running at once (default 64)")
    add("--max-batch-tokens", type=int, metavar="N", help="tokens per step (default 1024)")
    add("--scheduling-policy", choices=SCHEDULING_POLICIES,
        help="priority: admit by each request's priority (lower first, in [-1000, 1000]); "
        "fcfs (default, as vLLM): a request with a priority other than 0 is refused")
    add("--priority-aging-seconds", type=float, metavar="S",
        help="with --scheduling-policy priority, one step of priority is worth S seconds "
        "of waiting (default 0.01: no request waits behind better ones that arrived over "
        "20 s after it; 0: strict priority)")
    # Aging counted steps before; a step's length follows the load, so no number of seconds
    # stands for it: the old flag is refused by name rather than guessed at.
    add("--priority-aging-steps", type=int, help=argparse.SUPPRESS)
    add("--policy", choices=POLICIES,
        help="order of waiting requests (default lpm: longest cached prefix first)")
    add("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
        help="reuse nothing across requests (the baseline)")
    add("--speculation", choices=SPECULATION,
        help="speculative decoding: tree (drafts from the prefix tree and n-gram lookups, "
        "verified exactly) or off (default)")
    add("--num-speculative-tokens", type=int, metavar="N",
        help="at most N draft tokens per request and step (default 8)")
    add("--no-share-rows", dest="share_rows", action="store_false", default=None,
        help="compute identical requests in flight together separately (default: once)")
    add("--backend", choices=("auto", *BACKENDS), help="attention backend (default auto)")
    add("--threads", type=int, metavar="N", help="CPU threads for prefill (default: all cores)")
    add("--no-batch-invariant", dest="batch_invariant", action="store_false", default=None,
        help="faster kernels whose greedy answers may depend on the batch and the cache")
    add("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
        help="run decode steps eagerly on CUDA (default: replayed from CUDA graphs)")
    add("--kv-host-bytes", type=byte_size, metavar="SIZE",
        help="host-memory tier under the KV pool, e.g. 2G (default: off)")
    add("--kv-disk-dir", metavar="DIR",
        help="disk tier under the KV pool (kept across restarts; default: off)")
    add("--kv-disk-bytes", type=byte_size, metavar="SIZE",
        help="disk tier budget, e.g. 20G (default: half the free space, at most 16G)")
    add("--kv-remote", metavar="URL",
        help="remote KV tier every engine of the model shares: redis://[:password@]host:port/db "
        "or rediss:// (default: off)")
    add("--max-pinned-fraction", type=float, metavar="F",
        help="share of the KV pool pins may keep (stored conversations, Engine.pin; "
        "default 0.5)")
    add("--window-kv-fraction", type=float, metavar="F",
        help="sliding-window layers' KV: window slots per pool page (default 0.25; "
        "0: every page keeps every layer)")


def from_args(args: argparse.Namespace, **defaults: Any) -> EngineConfig:
    """The config ``add_arguments``' flags describe; ``defaults`` (plain knob names) apply
    where a flag was not given. ValueError names the knob (``page_size``, not the flag)."""
    if getattr(args, "priority_aging_steps", None) is not None:
        raise ValueError(
            "priority_aging_steps: gone; aging counts seconds waited now, not scheduler steps: "
            "--priority-aging-seconds S (one step of priority per S seconds, default 0.01)"
        )
    given = {
        name: getattr(args, name)
        for name in (*ENGINE_KNOBS, *SCHEDULER_KNOBS)
        if getattr(args, name, None) is not None
    }
    return EngineConfig.make(**{**defaults, **given})
