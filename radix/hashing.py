"""Content addresses for cached prefixes: an xxh3_64 chain over pages.

Page i's hash is ``xxh3_64(tokens of page i, seed=hash of page i-1)``; the first page is
seeded by the namespace, so equal tokens in two namespaces never share an address. A router,
a host-memory tier or a remote store can compute the chain from tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from radix.tokens import TOKEN_BYTES, encode_tokens

_xxh3 = xxhash.xxh3_64_intdigest


def namespace_seed(namespace: str | None) -> int:
    """The seed of a namespace's chain; None (the default namespace) differs from every str."""
    if namespace is None:
        return _xxh3(b"\x00radix-default-namespace")
    if not isinstance(namespace, str):
        raise ValueError(f"namespace: expected str or None, got {type(namespace).__name__}")
    return _xxh3(b"\x01" + namespace.encode("utf-8"))


def chain_hashes(buf: bytes, page_bytes: int, seed: int) -> list[int]:
    """The chain over the whole pages of canonical token bytes, starting from ``seed``."""
    out: list[int] = []
    h = seed
    for start in range(0, len(buf) - page_bytes + 1, page_bytes):
        h = _xxh3(buf[start : start + page_bytes], h)
        out.append(h)
    return out


def page_hashes(
    tokens: Sequence[int] | np.ndarray, page_size: int, namespace: str | None = None
) -> list[int]:
    """The hash chain of the whole pages of ``tokens`` (an unaligned tail is ignored).

    Equals the concatenated ``Node.page_hashes`` along the tree path holding these tokens.
    """
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: must be an int >= 1, got {page_size!r}")
    return chain_hashes(encode_tokens(tokens), page_size * TOKEN_BYTES, namespace_seed(namespace))
