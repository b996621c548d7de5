"""Engine fixtures: one engine on the bundled model (float32, CPU) shared by the whole session,
plus transformers' own greedy generate as the reference for every output we compare."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from engine_helpers import CHAT_PROMPTS, ENGINE_PAGES, user

from engine import Engine


@pytest.fixture(scope="session")
def engine(loaded_fp32: Any) -> Iterator[Engine]:
    """The shared engine: bundled model, float32 on the CPU, 256 pages of 16 tokens."""
    with Engine(model=loaded_fp32, page_size=16, num_pages=ENGINE_PAGES) as shared:
        yield shared


@pytest.fixture()
def make_engine(loaded_fp32: Any) -> Iterator[Callable[..., Engine]]:
    """Builds extra engines on the already loaded model (cheap: only a KV pool); closes them."""
    built: list[Engine] = []

    def build(**kwargs: Any) -> Engine:
        eng = Engine(model=loaded_fp32, **kwargs)
        built.append(eng)
        return eng

    yield build
    for eng in built:
        eng.close()


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Any) -> Callable[[Sequence[int], int], list[int]]:
    """transformers' greedy ``generate`` (memoised): the tokens it generates after ``ids``."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}
    eos = hf_model.generation_config.eos_token_id

    def run(ids: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in memo:
            input_ids = torch.tensor([list(ids)])
            with torch.inference_mode():
                out = hf_model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=eos if isinstance(eos, int) else eos[0],
                )
            memo[key] = out[0, input_ids.shape[1] :].tolist()
        return memo[key]

    return run


@pytest.fixture(scope="session")
def chat_ids(tokenizer: Any) -> list[list[int]]:
    """Token ids of CHAT_PROMPTS rendered with the chat template (as the engine renders them)."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(user(p), tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in CHAT_PROMPTS
    ]
