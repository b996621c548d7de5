"""A batched sampler whose seeded draws do not depend on the batch.

Randomness is Gumbel-max with noise that is a pure function of (seed, step, vocab index):
a counter-based hash evaluated with integer tensor ops. A seeded request therefore draws the
same token whichever rows share its batch, and the whole batch samples in one vectorised pass.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec
import torch

from engine.model.logit_adjust import adjust_logits
from scheduler.params import GREEDY_BELOW, SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for x in [0, 2**32) without int64 overflow (16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche mix (murmur3's finaliser) on int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    vocab_size: int,
    vocab_hash: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise ``[N, vocab]``, a pure function of (seed, step, vocab index)."""
    if vocab_hash is None:
        vocab_hash = mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) + 1)
    key = mix32((seeds >> 32) ^ 0x9E3779B9)
    key = mix32(key ^ (seeds & _M32))
    key = mix32(key ^ (steps & _M32))
    return -torch.log(-torch.log(uniform_of_hash(mix32(key[:, None] ^ vocab_hash[None, :]))))


# The largest float32 below 1: the top of the uniforms, so the noise stays finite.
_BELOW_ONE = 1.0 - 2.0**-24


def uniform_of_hash(h: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms strictly inside (0, 1) from 32-bit hashes (their top 24 bits).

    ``m + 0.5`` rounds to ``2**24`` in float32 for the top value ``m = 2**24 - 1``, and a
    uniform of exactly 1 is Gumbel noise of +inf: it would win over every logit, a masked
    one (-inf + inf = NaN, which argmax picks) included. That one value is clamped below 1;
    every other hash keeps the uniform it had."""
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return u.clamp_(max=_BELOW_ONE)


class TokenLogprob(msgspec.Struct, frozen=True):
    """The log-probability of a generated token under the model, and its best alternatives.

    Log-probabilities are of the model's own distribution (log-softmax of the raw logits),
    before temperature and filters, so they mean the same for every request (vLLM's default).
    ``top`` holds ``(token_id, logprob)`` of the most likely tokens, best first; ``rank`` is
    the token's place among them all (1: none is more likely; vLLM's rank).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int = 1


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int]
) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its ``counts[i]`` best alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    picked = logp.gather(1, tokens.view(-1, 1))
    ranks = ((logp > picked).sum(dim=-1) + 1).tolist()
    chosen = picked.view(-1).tolist()
    k = max(counts, default=0)
    top_ids: list[list[int]] = [[] for _ in counts]
    top_lp: list[list[float]] = [[] for _ in counts]
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        top_ids, top_lp = ids.tolist(), values.tolist()
    return [
        TokenLogprob(int(t), lp, list(zip(i[:c], v[:c])), r)
        for t, lp, i, v, c, r in zip(tokens.tolist(), chosen, top_ids, top_lp, counts, ranks)
    ]


class Sampler:
    """Picks one token per row of a logits matrix, all rows in one vectorised pass."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._vocab_hash: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _hash_of_vocab(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        key = (vocab_size, device)
        if key not in self._vocab_hash:
            idx = torch.arange(vocab_size, dtype=torch.int64, device=device)
            self._vocab_hash[key] = mix32(idx + 1)
        return self._vocab_hash[key]

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        prompts: Sequence[Sequence[int]] = (),
        outputs: Sequence[Sequence[int]] = (),
    ) -> torch.Tensor:
        """Token ids ``[N]`` (int64) for logits ``[N, vocab]``; ``steps[i]`` counts the
        tokens row i's request has generated so far (the counter of its seeded noise).
        ``prompts[i]``/``outputs[i]`` are row i's tokens, read by its penalties (needed only
        for rows whose params adjust the logits)."""
        n, vocab = logits.shape
        if len(params) != n or len(steps) != n:
            raise ValueError(
                f"params: need one SamplingParams and one step per logits row ({n}), "
                f"got {len(params)} and {len(steps)}"
            )
        logits = adjust_logits(logits.float(), params, prompts, outputs)
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy_tokens
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        greedy = temps < GREEDY_BELOW
        x = logits / torch.where(greedy, 1.0, temps)[:, None]
        x = self._apply_filters(x, params)
        seeds = torch.tensor(
            [p.seed if p.seed is not None else self._rng.getrandbits(63) for p in params],
            dtype=torch.int64,
            device=dev,
        )
        step_t = torch.tensor(list(steps), dtype=torch.int64, device=dev)
        noise = gumbel_noise(seeds, step_t, vocab, self._hash_of_vocab(vocab, dev))
        sampled = (x + noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def _apply_filters(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Mask to -inf what top-k, then top-p, then min-p exclude (per row)."""
        dev = x.device
        vocab = x.shape[1]
        neg_inf = torch.tensor(float("-inf"), device=dev)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                dtype=torch.int64,
                device=dev,
            )
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            sorted_x, order = x.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=dev)[None, :]
            drop = rank >= top_k[:, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
            drop = drop | ((before >= top_p[:, None]) & (rank > 0))
            x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            probs = x.softmax(dim=-1)
            limit = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            x = torch.where(probs < limit, neg_inf, x)
        return x
