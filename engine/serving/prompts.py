"""From what callers pass (text, token ids, chat messages) to the token ids of a prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.serving.validation import check_messages, check_text, check_token_ids, is_token_id

# One prompt: text, token ids, or a conversation [{"role": ..., "content": ...}, ...].
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


def split_prompts(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts (in input order).

    A str, a list of ints and a list of messages are each ONE prompt; a list of those is many.
    """
    prompts = _as_python(prompts)
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Mapping):
        raise ValueError(
            "prompts: a single message must be inside a list: [{'role': ..., 'content': ...}]"
        )
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(
            "prompts: expected str, token ids, chat messages or a list of them, "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts: empty list; expected at least one prompt")
    first = _as_python(prompts[0])
    if is_token_id(first) or isinstance(first, Mapping):
        return [prompts]
    return [_as_python(p) for p in prompts]


def render_messages(tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str) -> str:
    """The conversation as text, ready for the assistant's reply (the model's chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{field}: chat messages need a chat template; this model has none")
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True
    )


def encode_text(
    tokenizer: Any, text: str, add_special_tokens: bool = True, field: str = "prompt"
) -> list[int]:
    check_text(text, field)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_prompt(tokenizer: Any, prompt: Any, vocab_size: int, field: str) -> list[int]:
    """Token ids of one prompt; ValueError naming ``field`` when it is empty or malformed."""
    prompt = _as_python(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
        return check_token_ids(encode_text(tokenizer, prompt, field=field), vocab_size, field)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if len(prompt) == 0:
            raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
        if isinstance(prompt[0], Mapping):
            messages = check_messages(prompt, field)
            text = render_messages(tokenizer, messages, field)
            # The template writes the special tokens itself (BOS included where it has one).
            ids = encode_text(tokenizer, text, add_special_tokens=False)
            return check_token_ids(ids, vocab_size, field)
        return check_token_ids(prompt, vocab_size, field)
    raise ValueError(
        f"{field}: expected str, token ids or chat messages, got {type(prompt).__name__}"
    )


def _as_python(value: Any) -> Any:
    """numpy arrays and tensors of token ids -> lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value
