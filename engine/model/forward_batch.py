"""One ragged forward pass as tensors: what the model and the attention backends consume."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from scheduler.batch import Batch


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

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_batch(cls, batch: Batch, device: str | torch.device = "cpu") -> ForwardBatch:
        """Tensors for a scheduler ``Batch``; raises ValueError on inconsistent page tables."""
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
        ids = list(chain.from_iterable(e.input_ids for e in entries))
        positions = list(
            chain.from_iterable(range(e.start_pos, e.start_pos + len(e.input_ids)) for e in entries)
        )
        slots = list(chain.from_iterable(e.slots for e in entries))
        pages = list(chain.from_iterable(e.pages for e in entries))

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            input_ids=i64(ids),
            positions=i64(positions),
            slots=i64(slots),
            qo_indptr=i32(qo_indptr),
            kv_indptr=i32(kv_indptr),
            kv_indices=i32(pages),
            kv_last_page_len=i32(last_lens),
            logits_indices=i64(logits_indices),
            page_size=ps,
            decode_shaped=all(n == 1 and kv > 1 for n, kv in zip(qo_lens, kv_lens)),
            qo_lens=qo_lens,
            kv_lens=kv_lens,
            sample_rows=sample_rows,
        )
