"""How many CPU threads a forward pass gets: the team for big batches, one for small ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Batches of at least this many tokens run on every thread. Measured on the 2-core machine:
# a 1,024 x 576 x 1,536 matrix product runs 2.0x faster on two threads, but a decode step is a
# few thousand small ops, and synchronising a thread team per op made a decode-heavy chat
# workload 1.8x slower on two threads than on one.
PARALLEL_MIN_TOKENS = 128
# torch's thread count as the process started (its default: the machine's cores), read before
# any pass lowers it: a policy made after a decode step would otherwise get that step's one.
STARTING_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class ThreadPolicy:
    """Intra-op threads per forward pass on the CPU: ``max_threads`` for batches of at least
    ``parallel_min_tokens`` tokens (prefill chunks), one thread below that (decode steps)."""

    max_threads: int
    parallel_min_tokens: int = PARALLEL_MIN_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.max_threads, int) or self.max_threads < 1:
            raise ValueError(f"threads: must be an int >= 1, got {self.max_threads!r}")
        if self.parallel_min_tokens < 1:
            raise ValueError(
                f"parallel_min_tokens: must be >= 1, got {self.parallel_min_tokens!r}"
            )

    @classmethod
    def default(cls, threads: int | None) -> ThreadPolicy:
        """``threads`` at most; None: torch's thread count when this module was imported
        (its default, the machine's cores, unless the caller set it before)."""
        return cls(STARTING_THREADS if threads is None else threads)

    def threads_for(self, num_tokens: int) -> int:
        return self.max_threads if num_tokens >= self.parallel_min_tokens else 1

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads for a pass of ``num_tokens`` tokens, on the calling
        thread (the engine loop); a no-op when it is already right."""
        want = self.threads_for(num_tokens)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
