"""One ragged forward pass as tensors: what the model and the attention backends consume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import torch

from scheduler.batch import Batch

# The integers of one pass, in the order a packed buffer lays them out: 64-bit fields, then
# FlashInfer's 32-bit ones, the page list last (its length varies the most).
INDEX_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("input_ids", torch.int64),
    ("positions", torch.int64),
    ("slots", torch.int64),
    ("logits_indices", torch.int64),
    ("qo_indptr", torch.int32),
    ("kv_indptr", torch.int32),
    ("kv_last_page_len", torch.int32),
    ("append_batch_indices", torch.int32),
    ("append_positions", torch.int32),
    ("kv_indices", torch.int32),
)


class IndexPacker(Protocol):
    """Puts a pass's integers on the device in one copy (a platform's step buffers): the
    fields of ``INDEX_FIELDS`` as (device views, host views), each as long as its values."""

    def pack(
        self, values: Mapping[str, Sequence[int]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


@dataclass
class StepIndex:
    """A pass's integers as host lists, before they become tensors: what ``ForwardBatch``
    is made of, and what the decode graphs pad to a bucket before packing."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_indices: list[int]
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_last_page_len: list[int]
    append_batch_indices: list[int]  # each token's entry
    append_positions: list[int]  # each token's position (FlashInfer's int32 copy)
    kv_indices: list[int]
    page_size: int
    qo_lens: list[int]
    kv_lens: list[int]
    sample_rows: list[int]
    num_scored: int  # prompt-scoring rows at the end of ``logits_indices``

    @property
    def decode_shaped(self) -> bool:
        return all(n == 1 and kv > 1 for n, kv in zip(self.qo_lens, self.kv_lens))

    def values(self) -> dict[str, list[int]]:
        return {name: getattr(self, name) for name, _ in INDEX_FIELDS}

    @classmethod
    def of(cls, batch: Batch) -> StepIndex:
        """The index of a scheduler ``Batch``; raises ValueError on inconsistent page tables."""
        ps = batch.page_size
        if ps < 1:
            raise ValueError(f"page_size: must be >= 1, got {ps}")
        if not batch.entries:
            raise ValueError("entries: a batch needs at least one entry")
        qo_lens: list[int] = []
        kv_lens: list[int] = []
        last_lens: list[int] = []
        qo_indptr = [0]
        kv_indptr = [0]
        sample_rows: list[int] = []
        logits_indices: list[int] = []
        scored_rows: list[int] = []
        for i, e in enumerate(batch.entries):
            n = len(e.input_ids)
            if n < 1:
                raise ValueError(f"input_ids: entry {i} has no tokens")
            if len(e.slots) != n:
                raise ValueError(f"slots: entry {i} has {len(e.slots)} slots for {n} tokens")
            if e.start_pos < 0:
                raise ValueError(f"start_pos: entry {i} has {e.start_pos} < 0")
            kv_len = e.start_pos + n
            num_pages = -(-kv_len // ps)
            if len(e.pages) != num_pages:
                raise ValueError(
                    f"pages: entry {i} has {len(e.pages)} pages, needs {num_pages} "
                    f"for {kv_len} tokens at page_size {ps}"
                )
            qo_lens.append(n)
            kv_lens.append(kv_len)
            last_lens.append(kv_len - (num_pages - 1) * ps)
            qo_indptr.append(qo_indptr[-1] + n)
            kv_indptr.append(kv_indptr[-1] + num_pages)
            if e.sample:
                sample_rows.append(i)
                end = qo_indptr[-1]
                logits_indices.extend(range(end - e.num_logits, end))
            if e.scored:
                if not e.start_pos <= e.scored.start < e.scored.stop <= kv_len:
                    raise ValueError(
                        f"scored: entry {i} scores positions {e.scored.start}..."
                        f"{e.scored.stop - 1}, outside its {e.start_pos}...{kv_len - 1}"
                    )
                first = qo_indptr[-2] - e.start_pos
                scored_rows.extend(range(first + e.scored.start, first + e.scored.stop))
        logits_indices.extend(scored_rows)
        entries = batch.entries
        positions = list(
            chain.from_iterable(range(e.start_pos, e.start_pos + len(e.input_ids)) for e in entries)
        )
        return cls(
            input_ids=list(chain.from_iterable(e.input_ids for e in entries)),
            positions=positions,
            slots=list(chain.from_iterable(e.slots for e in entries)),
            logits_indices=logits_indices,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_last_page_len=last_lens,
            append_batch_indices=list(
                chain.from_iterable([i] * n for i, n in enumerate(qo_lens))
            ),
            append_positions=positions,
            kv_indices=list(chain.from_iterable(e.pages for e in entries)),
            page_size=ps,
            qo_lens=qo_lens,
            kv_lens=kv_lens,
            sample_rows=sample_rows,
            num_scored=len(scored_rows),
        )


@dataclass
class HostTables:
    """FlashInfer's plan arguments on the host (it reads them there: handing it device tensors
    makes it copy them back, a synchronisation per plan): views of the packed host buffer."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_indices: torch.Tensor  # for the cascade's search of shared pages


@dataclass
class ForwardBatch:
    """Tokens of all requests in one pass, with FlashInfer-convention page tables.

    Request ``b`` owns tokens ``qo_indptr[b]:qo_indptr[b+1]`` and pages
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; its KV length (after this pass's append) is
    ``(pages - 1) * page_size + kv_last_page_len[b]``. ``qo_lens``/``kv_lens`` repeat the
    lengths as host lists so planning needs no device round trip.
    """

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]: page * page_size + offset of each new token
    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [sum pages]
    kv_last_page_len: torch.Tensor  # int32 [B], in 1..page_size
    # int64 [S + P]: the last token of every entry that samples (and its draft tokens' rows),
    # then the ``P`` rows that score prompt tokens (``BatchEntry.scored``), entry by entry
    logits_indices: torch.Tensor
    page_size: int
    # Every request feeds exactly one token after a prefix: the decode kernels' shape. A
    # prompt's one-token last prefill chunk has it too (unlike ``BatchEntry.is_decode``).
    decode_shaped: bool
    qo_lens: list[int]
    kv_lens: list[int]
    sample_rows: list[int]  # entry indices whose logits are computed, in order
    # FlashInfer's append arguments, int32 [T] (None: derived when planning)
    append_batch_indices: torch.Tensor | None = None
    append_positions: torch.Tensor | None = None
    host: HostTables | None = field(default=None)  # None: the tables are on the host already

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_batch(
        cls, batch: Batch, device: str | torch.device = "cpu", buffers: IndexPacker | None = None
    ) -> ForwardBatch:
        """Tensors for a scheduler ``Batch``; raises ValueError on inconsistent page tables.
        With ``buffers`` every integer goes to the device in one packed copy."""
        return cls.from_index(StepIndex.of(batch), device, buffers)

    @classmethod
    def from_index(
        cls, index: StepIndex, device: str | torch.device = "cpu",
        buffers: IndexPacker | None = None,
    ) -> ForwardBatch:
        if buffers is not None:
            on_device, on_host = buffers.pack(index.values())
            tensors = on_device
            host: HostTables | None = HostTables(
                on_host["qo_indptr"], on_host["kv_indptr"], on_host["kv_last_page_len"],
                on_host["kv_indices"],
            )
        else:
            tensors = {
                name: torch.tensor(values, dtype=dtype, device=device)
                for (name, dtype), values in zip(INDEX_FIELDS, index.values().values())
                if name not in ("append_batch_indices", "append_positions")
            }
            host = None
        return cls(
            input_ids=tensors["input_ids"],
            positions=tensors["positions"],
            slots=tensors["slots"],
            qo_indptr=tensors["qo_indptr"],
            kv_indptr=tensors["kv_indptr"],
            kv_indices=tensors["kv_indices"],
            kv_last_page_len=tensors["kv_last_page_len"],
            logits_indices=tensors["logits_indices"],
            page_size=index.page_size,
            decode_shaped=index.decode_shaped,
            qo_lens=index.qo_lens,
            kv_lens=index.kv_lens,
            sample_rows=index.sample_rows,
            append_batch_indices=tensors.get("append_batch_indices"),
            append_positions=tensors.get("append_positions"),
            host=host,
        )
