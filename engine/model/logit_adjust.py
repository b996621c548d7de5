"""Per-request changes to the logits before sampling: a logit bias and vLLM's penalties.

Each request's row is changed by element-wise float32 operations that read only that row and
that request's own tokens, so a request's adjusted logits (and with them its greedy token) do not
depend on which other rows share the batch. Rows without adjustments are not touched.

Order, per row: ``logit_bias`` is added (OpenAI's), then the repetition penalty divides a
positive logit (multiplies a negative one) of every token seen in the prompt or the output, then
the frequency and presence penalties subtract ``frequency * count + presence * (count > 0)`` over
the output's tokens (vLLM's definitions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.device_copy import on_device
from scheduler.params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """``logits`` ([N, vocab], float32) with each row's bias and penalties applied; a new
    tensor when any row changes (the caller's logits stay the model's), else ``logits``.

    Only the logits of tokens a row's bias names or its penalties count are read and written
    (gathered by flat index ``row * vocab + token``, changed element-wise with that row's
    coefficients, scattered back): the cost follows the tokens involved, not the vocabulary,
    and a row's numbers are those it would get alone."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    vocab = logits.shape[1]
    dev = logits.device
    out = logits.clone()
    flat = out.view(-1)
    biased = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items()]
    if biased:
        where = on_device([i * vocab + t for i, t, _ in biased], torch.int64, dev)
        bias = on_device([b for _, _, b in biased], torch.float32, dev)
        flat.index_add_(0, where, bias)  # one add per (row, token): the keys are unique
    counted = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    repeated = [i for i in rows if params[i].penalises_prompt]
    if repeated:
        seen = _unique_pairs([(i, [*prompts[i], *outputs[i]]) for i in repeated], vocab, dev)[0]
        r = _per_pair(seen, vocab, {i: params[i].repetition_penalty for i in repeated}, dev)
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / r, values * r)
    if counted:
        pairs, counts = _unique_pairs([(i, outputs[i]) for i in counted], vocab, dev)
        if len(pairs):
            frequency = _per_pair(pairs, vocab, {i: params[i].frequency_penalty for i in counted}, dev)
            presence = _per_pair(pairs, vocab, {i: params[i].presence_penalty for i in counted}, dev)
            flat[pairs] = flat[pairs] - (frequency * counts.float() + presence)
    return out


def _unique_pairs(
    tokens: Sequence[tuple[int, Sequence[int]]], vocab: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct flat indices ``row * vocab + token`` of each row's tokens (ascending), and
    how often each occurs. (``torch.unique`` on a GPU waits for the device to size its output;
    counting them in Python instead costs more host time than that wait, at long prompts.)"""
    flat = [row * vocab + t for row, seq in tokens for t in seq]
    return torch.unique(on_device(flat, torch.int64, dev), return_counts=True)


def _per_pair(
    pairs: torch.Tensor, vocab: int, by_row: dict[int, float], dev: torch.device
) -> torch.Tensor:
    """Each pair's coefficient: its row's value."""
    table = [0.0] * (max(by_row) + 1)
    for row, value in by_row.items():
        table[row] = value
    return on_device(table, torch.float32, dev)[pairs // vocab]
