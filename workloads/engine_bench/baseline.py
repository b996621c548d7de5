"""What a user without an engine does: transformers' ``generate``, one request at a time.

Greedy, no cache shared between requests, same prompts (token ids) and output limits as the
engine run it is compared with. It runs in the engine's dtype, so the ratio measures the engine
(batching, prefix reuse), not a change of number format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch


class BaselineRequest(msgspec.Struct, frozen=True):
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False


class BaselineResult(msgspec.Struct):
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    total_tps: float
    output_ids: list[list[int]]


def load_baseline_model(model: str | None, dtype: torch.dtype) -> Any:
    """transformers' own model for ``model`` (None: the bundled one) in ``dtype`` on the CPU."""
    from engine import load_hf_reference

    return load_hf_reference(model).to(dtype)


def run_baseline(hf_model: Any, requests: Sequence[BaselineRequest], eos_token_ids: Sequence[int],
                 on_done: Callable[[int], None] | None = None) -> BaselineResult:
    """One ``generate`` call per request, in order; wall time covers all of them."""
    if not requests:
        raise ValueError("requests must not be empty")
    outputs: list[list[int]] = []
    with torch.inference_mode():  # warm-up: first-call costs stay out of the timing
        hf_model.generate(torch.tensor([requests[0].prompt_ids[:16]]), max_new_tokens=2,
                          do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, min(16, len(requests[0].prompt_ids)),
                                                    dtype=torch.long))
    started = time.perf_counter()
    with torch.inference_mode():
        for request in requests:
            ids = torch.tensor([request.prompt_ids], dtype=torch.long)
            kwargs: dict[str, Any] = {
                "max_new_tokens": request.max_new_tokens,
                "do_sample": False,
                "eos_token_id": list(eos_token_ids),
                "pad_token_id": eos_token_ids[0] if eos_token_ids else 0,
                "attention_mask": torch.ones_like(ids),
            }
            if request.ignore_eos:
                kwargs["min_new_tokens"] = request.max_new_tokens
            generated = hf_model.generate(ids, **kwargs)
            outputs.append(generated[0, ids.shape[1]:].tolist())
            if on_done is not None:
                on_done(1)
    wall = time.perf_counter() - started
    prompt = sum(len(r.prompt_ids) for r in requests)
    output = sum(len(o) for o in outputs)
    return BaselineResult(len(requests), prompt, output, wall, (prompt + output) / wall, outputs)
