"""A batched sampler whose seeded draws do not depend on the batch.

Randomness is Gumbel-max with noise that is a pure function of (seed, step, vocab index):
a counter-based hash evaluated with integer tensor ops. A seeded request therefore draws the
same token whichever rows share its batch, and the whole batch samples in one vectorised pass.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.api.outputs import TokenLogprob
from engine.model.device_copy import on_device, on_host
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


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int]
) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its ``counts[i]`` best alternatives."""
    return sampled_with_logprobs(tokens, logits, list(range(len(counts))), counts)[1]


def sampled_with_logprobs(
    tokens: torch.Tensor, logits: torch.Tensor, rows: Sequence[int], counts: Sequence[int]
) -> tuple[list[int], list[TokenLogprob]]:
    """Every row's sampled token, and for ``rows`` the chosen token's log-probability and
    its ``counts[i]`` best alternatives, in ONE device-to-host copy: everything is packed
    into one float64 tensor first (token ids, ranks and float32 log-probabilities are exact
    in float64), where reading each part alone took five copies and five synchronisations
    per step on a GPU."""
    n, k = len(rows), max(counts, default=0)
    if n == 0:
        return tokens.tolist(), []
    picked_rows = on_device(list(rows), torch.int64, logits.device)
    logp = logits[picked_rows].float().log_softmax(dim=-1)
    chosen = tokens[picked_rows]
    picked = logp.gather(1, chosen.view(-1, 1))
    ranks = (logp > picked).sum(dim=-1) + 1
    parts = [tokens.double(), picked.view(-1).double(), ranks.double()]
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        parts += [ids.double().view(-1), values.double().view(-1)]
    host = torch.cat(parts).tolist()
    m = len(tokens)
    sampled = [int(t) for t in host[:m]]
    lps, rank = host[m : m + n], host[m + n : m + 2 * n]
    top_ids, top_lp = host[m + 2 * n : m + 2 * n + n * k], host[m + 2 * n + n * k :]
    out = []
    for i, (row, count) in enumerate(zip(rows, counts)):
        alternatives = [
            (int(top_ids[i * k + j]), top_lp[i * k + j]) for j in range(count)
        ]
        out.append(TokenLogprob(sampled[row], lps[i], alternatives, int(rank[i])))
    return sampled, out


@dataclass
class _RowParams:
    """Each row's sampling numbers on the logits' device, from one host buffer in one copy
    (made one tensor at a time they were six copies per step on a GPU)."""

    temperature: torch.Tensor  # float32 [N]
    top_p: torch.Tensor  # float32 [N]
    min_p: torch.Tensor  # float32 [N]
    top_k: torch.Tensor  # int64 [N]: the vocabulary where there is no top-k
    seed: torch.Tensor  # int64 [N]
    step: torch.Tensor  # int64 [N]

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], steps: Sequence[int], rng: random.Random,
        device: torch.device, vocab: int,
    ) -> _RowParams:
        n = len(params)
        ints = [
            [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
            [p.seed if p.seed is not None else rng.getrandbits(63) for p in params],
            list(steps),
        ]
        floats = [[p.temperature for p in params], [p.top_p for p in params],
                  [p.min_p for p in params]]
        copied = not on_host(device)  # pinned: the copy is one DMA, queued behind the pass
        host = torch.empty(n * 36, dtype=torch.uint8, pin_memory=copied)
        host[: n * 24].view(torch.int64).view(3, n).copy_(torch.tensor(ints, dtype=torch.int64))
        host[n * 24 :].view(torch.float32).view(3, n).copy_(
            torch.tensor(floats, dtype=torch.float32)
        )
        moved = host.to(device, non_blocking=True) if copied else host
        i64 = moved[: n * 24].view(torch.int64).view(3, n)
        f32 = moved[n * 24 :].view(torch.float32).view(3, n)
        return cls(f32[0], f32[1], f32[2], i64[0], i64[1], i64[2])


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
        logits = logits.float()
        if any(p.adjusts_logits for p in params):  # bias, penalties: only rows that ask
            logits = adjust_logits(logits, params, prompts, outputs)
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy_tokens
        rows = _RowParams.of(params, steps, self._rng, logits.device, vocab)
        greedy = rows.temperature < GREEDY_BELOW
        x = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
        x = self._apply_filters(x, params, rows)
        noise = gumbel_noise(rows.seed, rows.step, vocab, self._hash_of_vocab(vocab, logits.device))
        sampled = (x + noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def _apply_filters(
        x: torch.Tensor, params: Sequence[SamplingParams], rows: _RowParams
    ) -> torch.Tensor:
        """Mask to -inf what top-k, then top-p, then min-p exclude (per row)."""
        dev = x.device
        vocab = x.shape[1]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            sorted_x, order = x.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=dev)[None, :]
            drop = rank >= rows.top_k[:, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
            drop = drop | ((before >= rows.top_p[:, None]) & (rank > 0))
            x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        if any(p.min_p > 0 for p in params):
            probs = x.softmax(dim=-1)
            limit = rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(probs < limit, float("-inf"))
        return x
