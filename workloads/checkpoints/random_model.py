"""Llama-shaped checkpoints with random weights, for machines the bundled model cannot reach.

The GPU machines take at most 64 MiB of files per call and reach no network, so the bundled
model's weights (98 MB as GGUF) cannot travel there. Its front (config and tokenizer, ~4 MB)
can: ``pack-front`` writes it here, and ``build`` makes, on the far machine, a checkpoint of
the same tokenizer with random weights in one of ``SHAPES`` (the bundled model's own shape
for correctness runs; a ~1B Llama shape for speed). Random weights make the same kernels do
the same work; their answers are meaningless but deterministic, which is all an exactness
check (cache on vs off, alone vs batched) needs.

    python -m workloads.checkpoints.random_model pack-front .gpu/front
    python -m workloads.checkpoints.random_model build .gpu/front /tmp/llama-1b --shape llama-1b
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

FRONT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

RANDOM_INIT_STD = 0.1

# Overrides of the bundled model's config.json (SmolLM2-135M: 576 wide, 30 layers, 9/3 heads).
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": {},
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    # Seconds on a CPU: runs the GPU bench's code in CI (``model_bench.gpu --smoke``).
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}


def pack_front(target: Path) -> Path:
    """The bundled model's config and tokenizer files (no weights) into ``target``."""
    from engine import bundled_gguf_path, checkpoint_dir

    source = checkpoint_dir(bundled_gguf_path())
    target.mkdir(parents=True, exist_ok=True)
    for name in FRONT_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def build(front: Path, target: Path, shape: str, seed: int = 0) -> Path:
    """A checkpoint directory at ``target``: ``front``'s tokenizer, its config with
    ``SHAPES[shape]`` applied, and random bfloat16 weights (seeded)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: unknown {shape!r}; known: {', '.join(SHAPES)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((front / "config.json").read_text())
    config.pop("quantization_config", None)  # the bundled config still names its GGUF
    config.update(SHAPES[shape])
    # At the usual 0.02 a random Llama repeats its last input token whatever the context, so
    # every answer agrees with every other and an exactness check could not fail; at 0.1 the
    # greedy tokens vary with the context and top-2 margins range from 0.003 to 2 (measured
    # on 4 prompts), as a trained model's do.
    config["initializer_range"] = RANDOM_INIT_STD
    target.mkdir(parents=True, exist_ok=True)
    for name in FRONT_FILES[1:]:
        if (front / name).is_file():
            shutil.copy2(front / name, target / name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack-front", help="the bundled model's config and tokenizer")
    pack.add_argument("target", type=Path)
    make = sub.add_parser("build", help="a random-weight checkpoint from a packed front")
    make.add_argument("front", type=Path)
    make.add_argument("target", type=Path)
    make.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    make.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.command == "pack-front":
        print(pack_front(args.target))
    else:
        print(build(args.front, args.target, args.shape, args.seed))


if __name__ == "__main__":
    main()
