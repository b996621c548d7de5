"""One forward pass worth of work, as plain lists: the engine turns it into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def slots_for(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    """The pool slots of positions ``start .. end - 1`` over page table ``pages``: the one
    place a position becomes ``page * page_size + offset``."""
    return [pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]


@dataclass
class BatchEntry:
    """The tokens one request feeds into this forward pass.

    ``input_ids`` sit at positions ``start_pos .. start_pos + len(input_ids) - 1``; the K/V of
    positions ``0 .. start_pos - 1`` is already in ``pages``. ``pages`` covers
    ``start_pos + len(input_ids)`` tokens (the page table after this step's append), and
    ``slots[i] = page * page_size + offset`` is where the K/V of ``input_ids[i]`` goes.
    ``sample`` is False for a prefill chunk that does not reach the end of what must be
    computed: its logits are not needed. ``draft`` (speculative decoding) are guessed tokens
    fed after the decode's token (``input_ids = [last sampled] + draft``): every one of its
    rows is sampled, and the longest prefix of the draft that matches is accepted.
    ``leader`` (``scheduler/shared_rows.py``): another entry of the pass whose request has
    this one's tokens and sampling; it is computed once, for both: the runner copies its K/V
    into this entry's slots and gives this entry (its follower) its tokens. ``scored``: the
    positions ``[start, end)`` of this entry whose logits score the prompt's next token
    (``SamplingParams.prompt_logprobs``); empty for every other entry.
    """

    request: Request
    input_ids: list[int]
    start_pos: int
    pages: list[int]
    slots: list[int]
    sample: bool
    draft: list[int] = field(default_factory=list)
    leader: BatchEntry | None = None
    scored: range = range(0)

    @classmethod
    def on_pages(
        cls,
        request: Request,
        input_ids: list[int],
        start_pos: int,
        pages: list[int],
        page_size: int,
        sample: bool = True,
    ) -> BatchEntry:
        """The entry feeding ``input_ids`` at ``start_pos`` over a page table (``pages`` may be
        longer than needed): its slots follow from the pages (hand-built batches: benchmarks,
        the invariance check, tests)."""
        kv_len = start_pos + len(input_ids)
        pages = list(pages[: pages_for(kv_len, page_size)])
        return cls(
            request, list(input_ids), start_pos, pages,
            slots_for(pages, page_size, start_pos, kv_len), sample,
        )

    @property
    def kv_len(self) -> int:
        return self.start_pos + len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """This entry feeds back the token sampled last step: a decode step of the request
        (it computes no prompt token). A prompt's one-token last prefill chunk is not one,
        though it has a decode's shape (``ForwardBatch.decode_shaped``, what kernels go by)."""
        return (
            len(self.input_ids) == 1 + len(self.draft)
            and self.start_pos > 0
            and bool(self.request.output)
        )

    @property
    def num_logits(self) -> int:
        """Rows of this entry that are sampled: the last token's, and one per draft token."""
        return 1 + len(self.draft) if self.sample else 0


@dataclass
class Batch:
    entries: list[BatchEntry]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries)

    @property
    def num_computed_rows(self) -> int:
        """Tokens the pass computes: followers' rows are their leaders' (``BatchEntry.leader``)."""
        return sum(len(e.input_ids) for e in self.entries if e.leader is None)

    @property
    def num_decode(self) -> int:
        return sum(1 for e in self.entries if e.is_decode)

