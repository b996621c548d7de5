"""``python -m workloads.checkpoints.export_hf DIR``: the bundled model as a plain HF checkpoint directory.

Peers (``vllm serve``, transformers, SGLang) load an HF directory. The engine's own cached
conversion of the bundled GGUF (``engine.model.loader.checkpoint_dir``) keeps a
``quantization_config`` naming the GGUF, which such loaders would read as a quantized model;
this writes the same config without it, the tokenizer files and the weights, so a peer runs
exactly the weights radixkv runs (dequantised once, float32).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def export(target: Path) -> Path:
    from engine import bundled_gguf_path, checkpoint_dir

    source = checkpoint_dir(bundled_gguf_path())
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != "config.json":
            shutil.copy2(item, target / item.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", type=Path, help="directory to write (created)")
    print(export(ap.parse_args(argv).target))


if __name__ == "__main__":
    main()
