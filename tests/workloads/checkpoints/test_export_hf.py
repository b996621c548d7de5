"""The bundled model exported as a plain HF directory loads in transformers as an ordinary
(unquantised) Llama whose logits are the reference model's: what a peer is pointed at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workloads.checkpoints.export_hf import export


def test_the_exported_directory_is_the_reference_model_unquantised(
    tmp_path: Path, hf_model: Any
) -> None:
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(
        export(tmp_path / "hf"), dtype=torch.float32, local_files_only=True
    )
    assert getattr(exported.config, "quantization_config", None) is None
    ids = torch.tensor([[1, 504, 2256, 314, 260, 3575, 282]])
    with torch.inference_mode():
        assert torch.equal(exported(ids).logits, hf_model(ids).logits)
