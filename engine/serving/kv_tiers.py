"""The KV tiers under an engine's pool, built from its config, and what keys the disk.

``kv_host_bytes`` budgets a host-memory store, ``kv_disk_dir``/``kv_disk_bytes`` a directory
of page files, ``kv_remote`` a Redis server every engine of the model shares. The disk's files sit under a *store key* naming everything a page's KV depends
on besides its tokens: the weights (a hash of every tensor), dtype, page size, KV layout, and
on the CPU the machine (CPU model, flags, torch, cores: the kernels that computed the KV), so
an engine only ever reads KV that it would itself have computed bit for bit. The remote
store's keys start with the same key: engines share pages with their own kind only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import xxhash

from engine.config import EngineConfig
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.platform import Platform
from engine.serving.kv_remote import RedisClient
from radix.tiers import DiskStore, HostStore, KVTiers, RemoteStore
from radix.tiers.disk import ensure_directory
from radix.tokens import TOKEN_BYTES

STORE_FORMAT = 1
REMOTE_VALUE_OVERHEAD = 128  # bytes a value costs Redis beyond its own: key, header, entry


def build_tiers(
    loaded: LoadedModel, pool: KVPool, config: EngineConfig, platform: Platform
) -> KVTiers | None:
    """The tiers the config asks for, or None (an evicted page is then recomputed)."""
    kv_host_bytes, kv_disk_dir = config.kv_host_bytes, config.kv_disk_dir
    host = HostStore(kv_host_bytes) if kv_host_bytes else None
    disk = remote = None
    meta = key = None
    if kv_disk_dir is not None or config.kv_remote:
        meta = store_meta(loaded, pool, platform)
        key = xxhash.xxh64(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    if kv_disk_dir is not None:
        directory = Path(kv_disk_dir).expanduser()
        ensure_directory(directory)  # its free space sizes the default budget
        kv_disk_bytes = config.disk_budget(directory)
        disk = DiskStore(directory, kv_disk_bytes, key)
        disk.write_manifest(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if config.kv_remote:
        client = RedisClient(config.kv_remote)
        budget = client.capacity_bytes()
        page_bytes = KVPool.bytes_per_page(
            pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype
        )
        value_bytes = page_bytes + pool.page_size * TOKEN_BYTES + REMOTE_VALUE_OVERHEAD
        capacity = budget // value_bytes if budget else None
        remote = RemoteStore(client, key, capacity_pages=capacity)
    if host is None and disk is None and remote is None:
        return None
    return KVTiers(pool, pool.page_size, host, disk, remote)


def store_meta(loaded: LoadedModel, pool: KVPool, platform: Platform) -> dict[str, Any]:
    """What a page's KV depends on besides its tokens (the disk store's key is its hash)."""
    return {
        "format": STORE_FORMAT,
        "weights": weights_fingerprint(loaded.model),
        "source": loaded.source.name,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "layers": pool.num_layers,
        "kv_heads": pool.num_kv_heads,
        "head_dim": pool.head_dim,
        "machine": platform.kv_identity(loaded.model.products),
    }


def weights_fingerprint(model: torch.nn.Module) -> str:
    """xxh3_128 over every parameter and buffer: names, dtypes, shapes and bytes."""
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()

