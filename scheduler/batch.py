"""One forward pass worth of work, as plain lists: the engine turns it into tensors."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Request


@dataclass
class BatchEntry:
    """The tokens one request feeds into this forward pass.

    ``input_ids`` sit at positions ``start_pos .. start_pos + len(input_ids) - 1``; the K/V of
    positions ``0 .. start_pos - 1`` is already in ``pages``. ``pages`` covers
    ``start_pos + len(input_ids)`` tokens (the page table after this step's append), and
    ``slots[i] = page * page_size + offset`` is where the K/V of ``input_ids[i]`` goes.
    ``sample`` is False for a prefill chunk that does not reach the end of what must be
    computed: its logits are not needed.
    """

    request: Request
    input_ids: list[int]
    start_pos: int
    pages: list[int]
    slots: list[int]
    sample: bool

    @property
    def kv_len(self) -> int:
        return self.start_pos + len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == 1 and self.start_pos > 0 and bool(self.request.output)


@dataclass
class Batch:
    entries: list[BatchEntry]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries)

    @property
    def num_decode(self) -> int:
        return sum(1 for e in self.entries if e.is_decode)

    @property
    def num_prefill(self) -> int:
        return len(self.entries) - self.num_decode
