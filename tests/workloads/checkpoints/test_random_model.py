"""Random-weight checkpoints for machines the bundled weights cannot reach (the GPU runs):
the bundled model's front travels without weights, and a checkpoint built from it loads, runs,
and answers differently for different contexts (so an exactness check on it can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.bringup.load import load_model
from workloads.checkpoints.random_model import build, pack_front


def test_a_checkpoint_built_from_the_packed_front_loads_and_depends_on_its_context(
    tmp_path: Path,
) -> None:
    import torch

    from engine import Engine
    from scheduler import SamplingParams

    front = pack_front(tmp_path / "front")
    assert not list(front.glob("*.safetensors")) and (front / "tokenizer.json").is_file()
    assert sum(f.stat().st_size for f in front.iterdir()) < 8 << 20  # travels in a device call
    ckpt = build(front, tmp_path / "model", "smollm2-135m", seed=3)
    loaded = load_model(ckpt, "cpu", "float32")
    assert loaded.config.num_layers == 30 and loaded.config.vocab_size == 49152
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49152, (40,), generator=gen).tolist() for _ in range(3)]
    with Engine(model=loaded, num_pages=64) as engine:
        answers = [o.token_ids for o in engine.generate(prompts, params)]
    assert len({tuple(a) for a in answers}) == 3
    assert all(len(set(a)) > 1 for a in answers)  # not one token repeated


def test_unknown_shape_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shape: unknown"):
        build(tmp_path, tmp_path / "x", "llama-70b")
