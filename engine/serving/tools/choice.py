"""Which ``ToolFormat`` a model gets: the one its chat template was trained on, else ours.

The chat template is the checkpoint's record of how the model was taught to call tools: a
template that writes ``<tool_call>`` blocks is the Hermes / Qwen format's; one that asks for
``{"name": ..., "parameters": ...}`` and has an ``ipython`` role is Llama 3.1+'s. Any other
template (or none: the bundled SmolLM2's knows no tools) gets radixkv's own, which needs
nothing from the template.
"""

from __future__ import annotations

from engine.serving.tools.format import ToolFormat
from engine.serving.tools.hermes import HERMES, OPEN
from engine.serving.tools.llama_json import LLAMA_JSON
from engine.serving.tools.radixkv import RADIXKV


def tool_format_for(chat_template: str | None) -> ToolFormat:
    """The tool format of a model with ``chat_template``."""
    if not chat_template or "tools" not in chat_template:
        return RADIXKV
    if OPEN.strip() in chat_template:
        return HERMES
    if "ipython" in chat_template and '"parameters"' in chat_template:
        return LLAMA_JSON
    return RADIXKV
