"""One forward pass plus sampling per scheduler batch: the model side of the engine loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import create_backend
from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool
from engine.loader import LoadedModel
from engine.rows import RowPadding
from engine.sampling import Sampler, SamplingParams
from engine.threads import ThreadPolicy
from scheduler.batch import Batch


class ModelRunner:
    """Runs ``loaded.model`` over a scheduler ``Batch`` with K/V in ``pool`` and samples.

    With a ``threads`` policy (CPU only), each pass sets torch's intra-op threads for its size;
    without one, torch's setting is left alone. With ``row_padding`` (the padding measured for
    the model's dtype) and ``attention_padding`` (for float32, attention's dtype) every pass is
    batch-invariant: matrix products run with padded row counts and attention is
    ``engine.attention.exact``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        pool: KVPool,
        backend: str = "torch",
        seed: int | None = None,
        threads: ThreadPolicy | None = None,
        row_padding: RowPadding | None = None,
        attention_padding: RowPadding | None = None,
    ) -> None:
        cfg = loaded.config
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError(
                "pool: shape (num_layers, num_kv_heads, head_dim) = "
                f"{(pool.num_layers, pool.num_kv_heads, pool.head_dim)} does not match the model's "
                f"{(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)}"
            )
        if pool.device.type != loaded.device.type:
            raise ValueError(f"pool: on {pool.device}, model on {loaded.device}")
        self.loaded = loaded
        self.pool = pool
        self.backend = create_backend(
            backend, cfg, loaded.device, None if row_padding is None else attention_padding
        )
        self.row_padding = row_padding
        self.sampler = Sampler(seed)
        self.threads = threads if loaded.device.type == "cpu" else None

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits ``[entries with sample=True, vocab]``; writes every token's K/V."""
        if batch.page_size != self.pool.page_size:
            raise ValueError(
                f"page_size: batch has {batch.page_size}, pool has {self.pool.page_size}"
            )
        fb = ForwardBatch.from_batch(batch, self.loaded.device)
        if self.loaded.model.row_padding != self.row_padding:  # a model shared by engines
            self.loaded.model.set_row_padding(self.row_padding)
        if self.threads is not None:
            self.threads.apply(fb.num_tokens)
        vocab = self.loaded.config.vocab_size
        if fb.input_ids.numel() and (
            int(fb.input_ids.min()) < 0 or int(fb.input_ids.max()) >= vocab
        ):
            raise ValueError(f"input_ids: token ids must be in [0, {vocab})")
        max_pos = self.loaded.config.max_position_embeddings
        if max(fb.kv_lens) > max_pos:
            raise ValueError(
                f"positions: sequence length {max(fb.kv_lens)} over the model's {max_pos}"
            )
        if fb.kv_indices.numel() and int(fb.kv_indices.max()) >= self.pool.num_pages:
            raise ValueError(f"pages: page id over the pool's {self.pool.num_pages} pages")
        return self.loaded.model(fb, self.pool, self.backend)

    @torch.inference_mode()
    def step(self, batch: Batch, params: Sequence[SamplingParams]) -> list[int]:
        """One token per entry (-1 where ``sample`` is False); params align with entries."""
        if len(params) != len(batch.entries):
            raise ValueError(
                f"params: {len(params)} SamplingParams for {len(batch.entries)} batch entries"
            )
        logits = self.forward(batch)
        out = [-1] * len(batch.entries)
        rows = [i for i, e in enumerate(batch.entries) if e.sample]
        if not rows:
            return out
        tokens = self.sampler.sample(
            logits,
            [params[i] for i in rows],
            [len(batch.entries[i].request.output) for i in rows],
        )
        for i, t in zip(rows, tokens.tolist()):
            out[i] = t
        return out
