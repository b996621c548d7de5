"""Row padding for batch-invariant matrix products.

A CPU BLAS picks its kernel by the shape of a product: on the machines measured here the fp32
GEMM gives row 0 of ``X @ W`` one value when X has 1-3 rows and another when it has 4 or more,
and with two threads also for 5-7 and 9-11 rows. A token's activations would then depend on how
many other tokens share its pass. Padding the row count of every product to a count whose
kernel agrees with the large-batch kernel makes each row's result independent of the batch. The
safe counts are measured on the machine (``measure``), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Row counts at or above this are checked only by samples: past the small-M paths, the kernels
# measured here block rows without changing a row's reduction over K.
DEFAULT_CHECK_UP_TO = 64
LARGE_SAMPLES = (65, 127, 128, 129, 256, 257, 1000, 1025)


@dataclass(frozen=True)
class RowPadding:
    """Row counts a product may run with: every count in ``good`` below ``min_any``, any count
    at or above ``min_any``. ``pad(m)`` is the smallest allowed count >= m."""

    good: tuple[int, ...] = ()
    min_any: int = 1

    def pad(self, m: int) -> int:
        if m >= self.min_any or m == 0:
            return m
        for g in self.good:
            if g >= m:
                return g
        return self.min_any

    def pad_rows(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x`` with rows along ``dim`` appended (copies of row 0) up to ``pad(rows)``."""
        m = x.shape[dim]
        extra = self.pad(m) - m
        if extra == 0:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x, x.narrow(dim, 0, 1).expand(shape)], dim=dim)

    def to_json(self) -> dict[str, object]:
        return {"good": list(self.good), "min_any": self.min_any}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> RowPadding:
        good = data.get("good", [])
        min_any = data.get("min_any", 1)
        if not isinstance(good, list) or not isinstance(min_any, int) or min_any < 1:
            raise ValueError(f"row padding: malformed {data!r}")
        return cls(tuple(int(g) for g in good), min_any)


NO_PADDING = RowPadding()


def _bad_rows(
    dtype: torch.dtype,
    threads: tuple[int, ...],
    shapes: tuple[tuple[int, int], ...],
    up_to: int,
    large: tuple[int, ...],
) -> tuple[set[int], bool]:
    """Row counts in 1..up_to whose products differ from the big product's rows, and whether
    any sampled larger count differs (then padding cannot make products invariant)."""
    gen = torch.Generator().manual_seed(0)
    counts = list(range(1, up_to + 1))
    bad: set[int] = set()
    large_bad = False
    before = torch.get_num_threads()
    try:
        for k, n in shapes:
            w = torch.randn(k, n, generator=gen).to(dtype)
            x = torch.randn(max(large, default=up_to) + 1, k, generator=gen).to(dtype)
            torch.set_num_threads(1)
            ref = torch.matmul(x, w)
            for t in threads:
                torch.set_num_threads(t)
                for m in counts:
                    if not torch.equal(torch.matmul(x[:m], w), ref[:m]):
                        bad.add(m)
                for m in large:
                    if not torch.equal(torch.matmul(x[:m], w), ref[:m]):
                        large_bad = True
    finally:
        torch.set_num_threads(before)
    return bad, large_bad


def measure(
    dtype: torch.dtype,
    threads: tuple[int, ...] = (1, 2),
    shapes: tuple[tuple[int, int], ...] = ((576, 960), (1536, 576), (64, 64), (64, 128)),
    up_to: int = DEFAULT_CHECK_UP_TO,
    large: tuple[int, ...] = LARGE_SAMPLES,
) -> RowPadding | None:
    """The padding that makes fp32/bf16 products row-invariant on this machine, for every
    thread count in ``threads``; None when no padding does (a large count differs too).

    The shapes cover a linear layer's (K, N) and attention's (head_dim, keys) products.
    """
    bad, large_bad = _bad_rows(dtype, threads, shapes, up_to, large)
    if large_bad:
        return None
    if not bad:
        return NO_PADDING
    min_any = max(bad) + 1
    good = tuple(m for m in range(1, min_any) if m not in bad)
    return RowPadding(good, min_any)
