"""Tool calling: the tools a request offers, written into its conversation by the model's
format, the reply constrained to a call where ``tool_choice`` asks, and the calls read back
whole or as they stream.

- ``use``: ``prepare``, every door's one call for a conversation (``Engine.generate``,
  ``ChatSession``, the chat endpoint, ``/v1/responses``, ``/tokenize``), and ``ToolUse``, the
  object that reads the reply back (``calls``, ``parse``, ``stream``);
- ``format``: ``ToolFormat``, the plug point a model family's own format implements;
- ``radixkv``: radixkv's own format (``RADIXKV``), for models without one;
- ``hermes``: Hermes / Qwen's ``<tool_call>`` format (``HERMES``), its template writing the tools;
- ``llama_json``: Llama 3.1+'s one-object format (``LLAMA_JSON``), likewise;
- ``choice``: ``tool_format_for``, a model's format by its chat template;
- ``stream``: ``CallStream``, a streamed reply read as it grows;
- ``checks``: OpenAI's ``tools`` and ``tool_choice`` checked, whatever the format.

This package is ``engine.tools`` to the server and the cluster.
"""

from engine.serving.tools.checks import check_json_schema, check_tools
from engine.serving.tools.choice import tool_format_for
from engine.serving.tools.format import CallReader, ToolFormat
from engine.serving.tools.hermes import HERMES
from engine.serving.tools.llama_json import LLAMA_JSON
from engine.serving.tools.radixkv import RADIXKV
from engine.serving.tools.stream import CallStream
from engine.serving.tools.use import (
    CONVERSATIONS_ONLY,
    NO_TOOLS,
    ToolPrompt,
    ToolUse,
    prepare,
    render_history,
)

__all__ = [
    "CONVERSATIONS_ONLY", "HERMES", "LLAMA_JSON", "NO_TOOLS", "RADIXKV", "CallReader", "CallStream",
    "ToolFormat", "ToolPrompt", "ToolUse", "check_json_schema", "check_tools", "prepare",
    "render_history", "tool_format_for",
]
