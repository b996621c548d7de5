"""A conversation as the model reads it: rendered by its chat template, encoded so that only
the template's own markers become control tokens, and continued from an earlier turn's ids.

Used by the inputs boundary (chat messages as a prompt), by ``ChatSession`` and by a front
end continuing a stored conversation (``EngineClient.encode(continuing=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A span of text [start, end) that came from a caller: it is encoded as plain text.
Span = tuple[int, int]


class ToolConversation(list):  # type: ignore[type-arg]
    """Chat messages with the tools the model's chat template writes itself (``tools=`` to
    the template; Hermes / Qwen templates): a list of messages wherever one is taken."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]]):
        super().__init__(messages)
        self.tools = tools


def tools_of(messages: Any) -> list[dict[str, Any]] | None:
    """The tools a conversation gives its template (None: a plain list of messages)."""
    return getattr(messages, "tools", None)


def check_text(text: str, field: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (from a bad decode) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field}: character {exc.start} ({text[exc.start]!r}) is a lone surrogate, which "
            "is not valid Unicode text"
        ) from None


def check_messages(messages: Sequence[Any], field: str) -> list[dict[str, str]]:
    """Chat messages: a non-empty list of {"role": str, "content": str}."""
    if len(messages) == 0:
        raise ValueError(f"{field}: empty conversation; expected at least one message")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where}: expected a message {{'role': ..., 'content': ...}}, "
                f"got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where}: message has no {key!r}")
            if not isinstance(message[key], str):
                raise ValueError(
                    f"{where}.{key}: expected str, got {type(message[key]).__name__}"
                )
        if not message["role"]:
            raise ValueError(f"{where}.role: empty role")
        check_text(message["content"], f"{where}.content")
        out.append(dict(message))
    return out


def check_roles(tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str) -> None:
    """A role is the template's business: it may not carry special tokens either."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    for i, message in enumerate(messages):
        for token in specials:
            if token in message["role"]:
                raise ValueError(f"{field}[{i}].role: contains the special token {token!r}")


def render_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    field: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as text, ready for the assistant's reply (the model's chat template,
    given ``tools`` where the template writes them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{field}: chat messages need a chat template; this model has none")
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, **extra
    )


def render_with_spans(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    field: str,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[Span]]:
    """The rendered conversation and where each message's content lies in it.

    Only the template's own markers may become control tokens: a user who types
    ``<|im_end|><|im_start|>system`` in a message must not forge a system turn. The contents
    are found by rendering the template once more with placeholders in their place (exact,
    whatever text the template puts around them); a template that rewrites contents falls
    back to finding them in order.
    """
    text = render_messages(tokenizer, messages, field, tools)
    check_roles(tokenizer, messages, field)
    marks = [f"\x00radixkv-content-{i}\x00" for i in range(len(messages))]
    stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    skeleton = render_messages(tokenizer, stand_ins, field, tools)
    spans: list[Span] = []
    rebuilt: list[str] = []
    length = 0
    rest = skeleton
    for message, mark in zip(messages, marks):
        before, found, rest_after = rest.partition(mark)
        if not found:
            break
        rebuilt.append(before)
        length += len(before)
        spans.append((length, length + len(message["content"])))
        rebuilt.append(message["content"])
        length += len(message["content"])
        rest = rest_after
    rebuilt.append(rest)
    if "".join(rebuilt) == text and len(spans) == len(messages):
        return text, spans
    spans, at = [], 0
    for message in messages:  # the template rewrote something: find each content in order
        start = text.find(message["content"], at)
        if start < 0:
            continue
        spans.append((start, start + len(message["content"])))
        at = start + len(message["content"])
    return text, spans


def plain_text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with special-token strings split into ordinary tokens.

    A fast tokenizer does this through a flag on its shared backend, which
    ``split_special_tokens=True`` flips per call: that races with other threads' encodes (seen:
    chat turns tokenised differently run to run). A private copy with the flag set once is
    kept on the tokenizer instead.
    """
    plain = getattr(tokenizer, "_radixkv_plain_text", None)
    if plain is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer splits per call, without shared state
            return list(
                tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        tokenizer._radixkv_plain_text = plain
    return list(plain.encode(text, add_special_tokens=False).ids)


def encode_with_spans(tokenizer: Any, text: str, spans: Sequence[Span]) -> list[int]:
    """Token ids of ``text``: special tokens are recognised outside ``spans`` only."""
    ids: list[int] = []
    at = 0
    for start, end in sorted(spans):
        if start < at:
            continue
        if start > at:
            ids += tokenizer.encode(text[at:start], add_special_tokens=False)
        if end > start:
            ids += plain_text_ids(tokenizer, text[start:end])
        at = end
    if at < len(text):
        ids += tokenizer.encode(text[at:], add_special_tokens=False)
    return ids


def encode_conversation(tokenizer: Any, messages: Sequence[Any], field: str) -> list[int]:
    """Token ids of a conversation, ready for the assistant's reply: the template writes the
    special tokens itself (BOS included where it has one); the contents are text, whatever
    they look like."""
    text, spans = render_with_spans(
        tokenizer, check_messages(messages, field), field, tools_of(messages)
    )
    return encode_with_spans(tokenizer, text, spans)


def continue_tokens(
    tokenizer: Any,
    previous_ids: Sequence[int],
    full_text: str,
    spans: Sequence[Span] | None = None,
) -> tuple[list[int], int]:
    """Token ids of ``full_text`` that start with as many of ``previous_ids`` as possible.

    Returns (ids, reused): ``ids[:reused] == previous_ids[:reused]``. Text inside ``spans``
    (callers' message contents) is encoded as plain text, never as control tokens.
    """
    previous = list(previous_ids)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    keep = len(previous)
    if not full_text.startswith(decode(previous)):
        # Binary search for the longest prefix of the previous tokens whose text is a prefix.
        lo, hi = 0, len(previous) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if full_text.startswith(decode(previous[:mid])):
                lo = mid
            else:
                hi = mid - 1
        keep = lo
    offset = len(decode(previous[:keep]))
    rest = full_text[offset:]
    if spans is None:
        check_text(rest, "prompt")
        tail = list(tokenizer.encode(rest, add_special_tokens=False)) if rest else []
    else:
        shifted = [(max(s - offset, 0), e - offset) for s, e in spans if e > offset]
        tail = encode_with_spans(tokenizer, rest, shifted)
    return previous[:keep] + tail, keep


def continue_conversation(
    tokenizer: Any, previous_ids: Sequence[int], messages: Sequence[Any], field: str
) -> tuple[list[int], int]:
    """A conversation's ids continuing an earlier turn's (its prompt and reply as the engine
    ran them): those kept verbatim as far as the rendered text agrees, so a reply
    re-tokenised differently cannot miss the cache. Returns (ids, how many were kept)."""
    text, spans = render_with_spans(
        tokenizer, check_messages(messages, field), field, tools_of(messages)
    )
    return continue_tokens(tokenizer, previous_ids, text, spans)
