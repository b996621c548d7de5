"""Our two native kernels together (the products and the attention kernel): their version, and
whether both load here.

A verdict measured on them (the dtype probe) and KV they computed (the disk tier's store) is
kept under ``kernels_key``, so a new version of either source, their shared header or their
loader is measured and computed afresh.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from engine.model.cpu import exact_attention, native_build, products


def kernels_key() -> str:
    """The kernels' sources, their shared header and their loader, hashed."""
    h = xxhash.xxh64()
    for source in (
        products.SOURCE,
        exact_attention.SOURCE,
        products.SOURCE.parent / "guard.h",
        Path(native_build.__file__),
    ):
        h.update(source.read_bytes())
    return h.hexdigest()


def kernels_loaded() -> bool:
    """Whether both native kernels load in this process (built and self-tested)."""
    return products.load_products() is not None and exact_attention.load_kernel() is not None
