"""One forward pass plus sampling per scheduler batch: the model side of the engine loop."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.api.outputs import TokenLogprob
from engine.model.attention.base import AttentionBackend
from engine.model.device_copy import on_device
from engine.model.forward_batch import ForwardBatch, StepIndex
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.platform import GraphedPasses, Platform
from engine.model.sampler import Sampler, sampled_with_logprobs, token_logprobs
from engine.model.structured import Grammars
from scheduler.batch import Batch, BatchEntry, slots_for

log = logging.getLogger("radixkv.engine")

# Prompt rows scored at once: bounds the log-softmax's memory (rows x vocabulary floats).
_SCORE_ROWS = 256


@dataclass
class StepResult:
    """What one step produced, per batch entry: the tokens it generated (none for an entry that
    only prefills; one for a decode; for an entry with a draft, the accepted draft tokens and
    then the model's own next one) and their log-probabilities (empty unless the request asked
    for them)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]]
    # Per entry, the log-probability of each prompt token its ``scored`` rows predict.
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    # Requests (by id) whose grammar llguidance stopped following in this step, and why: their
    # rows allowed EOS alone, so the caller fails them rather than let them end "stop".
    grammar_errors: dict[Any, str] = field(default_factory=dict)


class ModelRunner:
    """Runs ``loaded.model`` over a scheduler ``Batch`` with K/V in ``pool`` and samples.

    What differs by device comes from ``platform`` (``engine.model.platform``): the attention
    backend ``backend`` names, products packed once per model where the platform has its own
    (the CPU's batch-invariant ones), the threads each pass runs on, the one copy a pass's
    integers take to the device, and the decode graphs. With ``batch_invariant`` every pass is
    batch-invariant where both the products and the attention are (the bring-up verifies it
    before an engine serves: ``engine.model.bringup``).

    Batches come from the scheduler, whose requests were validated at the engine's boundary,
    so nothing is re-checked per step (such checks read tensors back to the host, which
    synchronises a GPU); ``debug_checks=True`` (or ``RADIXKV_DEBUG_CHECKS=1``) adds them.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        pool: KVPool,
        platform: Platform,
        backend: str = "torch",
        seed: int | None = None,
        batch_invariant: bool = False,
        debug_checks: bool | None = None,
        grammars: Grammars | None = None,
        cuda_graphs: bool = False,
        max_batch: int = 64,
        max_verify_rows: int = 0,
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
        self.platform = platform
        if loaded.model.products is None:  # a model shared by engines is packed once
            packer = platform.packer(loaded.dtype)
            if packer is not None:
                loaded.model.use_packed_products(packer, platform.row_ops())
        self.product_threads = platform.product_threads
        self.backend = platform.attention_backend(
            backend, cfg, batch_invariant, self.product_threads, loaded.dtype
        )
        # Invariant only where both the products (the platform's own, or the vendor's where
        # its rows do not depend on the row count) and the attention plan are.
        products_invariant = (
            loaded.model.products is not None or platform.torch_products_invariant
        )
        self.batch_invariant = batch_invariant and products_invariant and self.backend.exact
        self.buffers = platform.step_buffers()  # a pass's integers in one copy, where it pays
        self.graphs: GraphedPasses | None = None
        if cuda_graphs:
            self.graphs = self._decode_graphs_or_eager(max_batch, max_verify_rows)
        self.sampler = Sampler(seed)
        # Structured outputs: masks each constrained row before sampling (None: not built).
        self.grammars = grammars
        if debug_checks is None:
            debug_checks = os.environ.get("RADIXKV_DEBUG_CHECKS", "0") not in ("", "0")
        self.debug_checks = debug_checks

    def _decode_graphs_or_eager(self, max_batch: int, max_rows: int) -> GraphedPasses | None:
        """The decode graphs, or None (decode runs eagerly) when building or capturing them
        fails on this device: a slower engine that says why, not one that cannot start.
        A misconfiguration (``ValueError``) is still the caller's error."""
        try:
            return self._decode_graphs(max_batch, max_rows)
        except ValueError:
            raise
        except Exception as error:  # a CUDA, cuBLAS or FlashInfer error while capturing
            self.platform.release_cached_memory()
            message = (
                f"cuda_graphs: capturing the decode graphs failed on {self.loaded.device} "
                f"({type(error).__name__}: {error}); decode steps run eagerly"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return None

    def drop_graphs(self) -> None:
        """Decode steps run eagerly from now on (the graphs' memory is released)."""
        self.graphs = None
        self.platform.release_cached_memory()

    def _decode_graphs(self, max_batch: int, max_rows: int) -> GraphedPasses:
        """The platform's decode graphs over the runner's backend, with verify graphs of up
        to ``max_rows`` rows where it makes them. A batch-invariant runner checks each
        bucket's first replay against its eager pass."""
        cfg = self.loaded.config
        context = min(int(cfg.max_position_embeddings), self.pool.num_pages * self.pool.page_size)
        model = self.loaded.model
        threads = self.product_threads

        def forward(fb: ForwardBatch, attention: AttentionBackend) -> torch.Tensor:
            return model.forward_planned(fb, self.pool, attention, threads)

        return self.platform.decode_graphs(
            self.backend, self.pool, forward, self._eager if self.batch_invariant else None,
            max_batch, -(-context // self.pool.page_size), max_rows,
        )

    def _eager(self, index: StepIndex) -> torch.Tensor:
        """The pass ``index`` without graphs (logits of its sampled rows)."""
        fb = ForwardBatch.from_index(index, self.loaded.device, self.buffers)
        return self.loaded.model(fb, self.pool, self.backend, self.product_threads)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits ``[entries with sample=True, vocab]``; writes every token's K/V.
        Decode and verify passes run in the graphs where there are some."""
        index = StepIndex.of(batch)
        if self.debug_checks:
            self._check(batch, ForwardBatch.from_index(index))
        self.platform.pass_threads(len(index.input_ids))
        if self.graphs is not None:
            shape = self.graphs.shape_for(index)
            if shape is not None:
                return self.graphs.run(index, shape)
        return self._eager(index)

    def _check(self, batch: Batch, fb: ForwardBatch) -> None:
        """What the scheduler and the engine's validation already guarantee (debugging)."""
        if batch.page_size != self.pool.page_size:
            raise ValueError(
                f"page_size: batch has {batch.page_size}, pool has {self.pool.page_size}"
            )
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

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepResult:
        """The tokens each entry generates (none where ``sample`` is False), by each request's
        params, and the log-probabilities of the requests that asked for them.

        An entry with a draft has a row per position; row j is sampled exactly as plain
        decoding would sample that request's next token after the first j draft tokens (the
        seeded noise is keyed by the token's index in the output, penalties read the output
        with those drafts), and the drafts are accepted while they equal what was sampled, so
        greedy and seeded answers are the same with and without speculation.

        A follower entry (``BatchEntry.leader``) is not computed: its leader's K/V is copied into
        its slots and it gets its leader's tokens, which its own rows would have been (the
        scheduler pairs only identical requests with deterministic sampling, and only where
        a row does not depend on its pass)."""
        if any(e.leader is not None for e in batch.entries):
            return self._step_with_followers(batch)
        logits = self.forward(batch)
        entries = batch.entries
        out = StepResult([[] for _ in entries], [[] for _ in entries])
        num_scored = sum(len(e.scored) for e in entries)
        if num_scored:
            out.prompt_logprobs = self._score_prompts(entries, logits[-num_scored:])
            logits = logits[:-num_scored]
        spans: list[tuple[int, int]] = []  # (entry, its first row)
        requests: list[Any] = []
        steps: list[int] = []
        outputs: list[list[int]] = []
        for i, entry in enumerate(entries):
            if not entry.sample:
                continue
            request = entry.request
            spans.append((i, len(requests)))
            adjusts = request.params.adjusts_logits
            for j in range(entry.num_logits):
                requests.append(request)
                steps.append(len(request.output) + j)
                outputs.append(request.output + entry.draft[:j] if j and adjusts else request.output)
        if not requests:
            return out
        allowed = logits
        # Grammars only where a row is constrained: a batch without one pays nothing for them.
        constrained = any(r.params.structured_outputs is not None for r in requests)
        grammars = self.grammars if constrained else None
        if grammars is not None:
            allowed = grammars.mask(
                logits, [(entries[i].request, entries[i].draft, first) for i, first in spans]
            )
            out.grammar_errors = grammars.take_errors()
        allowed = _hold_stops(allowed, logits, requests, steps)
        tokens = self.sampler.sample(
            allowed, [r.params for r in requests], steps, [r.prompt for r in requests], outputs
        )
        wants = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
        sampled, scores = sampled_with_logprobs(
            tokens, logits, wants, [requests[j].params.logprobs for j in wants]
        )  # one copy to the host per step
        found: dict[int, TokenLogprob] = dict(zip(wants, scores))
        for i, first in spans:
            draft = entries[i].draft
            accepted = 0
            while accepted < len(draft) and sampled[first + accepted] == draft[accepted]:
                accepted += 1
            out.tokens[i] = sampled[first : first + accepted + 1]
            if found:
                out.logprobs[i] = [
                    found[j] for j in range(first, first + accepted + 1) if j in found
                ]
        if grammars is not None:
            grammars.accept([(entries[i].request, out.tokens[i]) for i, _ in spans])
        return out

    @staticmethod
    def _score_prompts(
        entries: list[BatchEntry], logits: torch.Tensor
    ) -> list[list[TokenLogprob]]:
        """Each entry's prompt tokens scored by the rows before them (``BatchEntry.scored``),
        a few hundred rows at a time (a row's log-softmax is a vocabulary of floats)."""
        scores: list[list[TokenLogprob]] = []
        row = 0
        for entry in entries:
            found: list[TokenLogprob] = []
            span = entry.scored
            prompt = entry.request.prompt
            count = entry.request.params.prompt_logprobs or 0
            for start in range(span.start, span.stop, _SCORE_ROWS):
                stop = min(start + _SCORE_ROWS, span.stop)
                rows = logits[row : row + stop - start]
                targets = on_device(prompt[start + 1 : stop + 1], torch.int64, logits.device)
                found.extend(token_logprobs(rows, targets, [count] * (stop - start)))
                row += stop - start
            scores.append(found)
        return scores

    def _step_with_followers(self, batch: Batch) -> StepResult:
        """Computes the entries that are not followers; a follower gets its leader's K/V for its
        positions (computed in earlier steps or in this one) and its leader's tokens: those
        already known at its draft's start, then what the leader's rows produced now."""
        entries, p = batch.entries, batch.page_size
        computed = [e for e in entries if e.leader is None]
        result = self.step(Batch(computed, p))
        at = {id(e): i for i, e in enumerate(computed)}
        src: list[int] = []
        dst: list[int] = []
        out = StepResult([], [], None if result.prompt_logprobs is None else [],
                         result.grammar_errors)
        for entry in entries:
            leader = entry.leader
            i = at[id(entry if leader is None else leader)]
            if out.prompt_logprobs is not None:  # a follower decodes: it scores no prompt
                out.prompt_logprobs.append([] if leader is not None else result.prompt_logprobs[i])
            if leader is None:
                out.tokens.append(result.tokens[i])
                out.logprobs.append(result.logprobs[i])
                continue
            known = entry.draft[: leader.start_pos - entry.start_pos]
            out.tokens.append(known + result.tokens[i])
            out.logprobs.append([])
            src.extend(slots_for(leader.pages, p, entry.start_pos, entry.kv_len))
            dst.extend(entry.slots)
        self.pool.copy_slots(src, dst)
        return out


def _hold_stops(
    allowed: torch.Tensor, logits: torch.Tensor, requests: list[Any], steps: list[int]
) -> torch.Tensor:
    """Rows of requests short of their ``min_tokens`` with their stop tokens (EOS unless
    ignored, the stop ids) at -inf: element-wise on those rows only, in a copy where
    ``allowed`` is still the model's logits (log-probabilities stay the model's)."""
    early = [j for j, r in enumerate(requests) if steps[j] < r.params.min_tokens]
    if not early:
        return allowed
    if allowed is logits:
        allowed = logits.clone()
    for j in early:
        banned = sorted(requests[j].stop_tokens())
        if banned:
            allowed[j, on_device(banned, torch.int64, allowed.device)] = float("-inf")
    return allowed
