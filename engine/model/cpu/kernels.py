"""Our two native kernels together (the products and the attention kernel): their version, and
whether both load here.

A verdict measured on them (the dtype probe) and KV they computed (the disk tier's store) is
kept under ``kernels_key``, so a new version of either source, a header they include, their
loader or the products' choice of path is measured and computed afresh.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from engine.model.cpu import exact_attention, native_build, products


def kernels_key() -> str:
    """The kernels' sources with every header they include, their loader and the products'
    choice of path (the AMX tiles or not, ``RADIXKV_AMX``), hashed."""
    h = xxhash.xxh64()
    for source in (products.SOURCE, exact_attention.SOURCE):
        for text in native_build.source_texts(source):
            h.update(text.encode())
    for module in (native_build.__file__, products.__file__):
        h.update(Path(module).read_bytes())
    h.update(os.environ.get(products.TILES_ENV, "1").encode())
    return h.hexdigest()


def kernels_loaded() -> bool:
    """Whether both native kernels load in this process (built and self-tested)."""
    return products.load_products() is not None and exact_attention.load_kernel() is not None
