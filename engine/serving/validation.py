"""Checks on everything a caller hands the engine, done before anything is queued.

Every check raises ValueError with a message that names the field and the limit, so a caller
can fix the request without reading our code.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from engine.api import ContextLengthError, context_limit
from scheduler import SamplingParams


def is_token_id(value: Any) -> bool:
    """True for an int-like value (numpy ints included); False for bool, which is no token."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(ids: Sequence[Any], vocab_size: int, field: str) -> list[int]:
    """Returns the ids as plain ints; raises if one is not an int or is outside the vocabulary."""
    if len(ids) == 0:
        raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
    out: list[int] = []
    for i, value in enumerate(ids):
        if not is_token_id(value):
            raise ValueError(
                f"{field}[{i}]: expected an int token id, got {type(value).__name__}"
            )
        token = int(value)
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"{field}[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})"
            )
        out.append(token)
    return out


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


def check_params(params: Any, num_prompts: int, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (defaults), one for all, or a list of them."""
    if params is None:
        params_list = [SamplingParams()] * num_prompts
    elif isinstance(params, SamplingParams):
        params_list = [params] * num_prompts
    elif isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != num_prompts:
            raise ValueError(
                f"params: got {len(params)} SamplingParams for {num_prompts} prompts; "
                "pass one, or exactly one per prompt"
            )
        params_list = list(params)
    else:
        raise ValueError(
            f"params: expected SamplingParams or a list of them, got {type(params).__name__}"
        )
    checked: dict[int, SamplingParams] = {}
    for i, p in enumerate(params_list):
        if id(p) in checked:
            continue
        field = "params" if len(params_list) == 1 or params_list[0] is p else f"params[{i}]"
        if not isinstance(p, SamplingParams):
            raise ValueError(f"{field}: expected SamplingParams, got {type(p).__name__}")
        p = _own_copy(p, field)
        for token in p.stop_token_ids:
            if token >= vocab_size:
                raise ValueError(
                    f"{field}.stop_token_ids: {token!r} is not a token id in [0, {vocab_size})"
                )
        for token in p.logit_bias:
            if token >= vocab_size:
                raise ValueError(
                    f"{field}.logit_bias: {token!r} is not a token id in [0, {vocab_size})"
                )
        checked[id(params_list[i])] = p
    return [checked[id(p)] for p in params_list]


def _own_copy(params: SamplingParams, field: str) -> SamplingParams:
    """The engine's own copy of ``params``, validated again. The struct is frozen but its
    lists and dict are not: a caller who changed one after making it (a NaN bias, a
    negative stop id) would have skipped the check, and one who changes it while the
    request runs would change it under the engine, whose loop copies params to compare
    requests (and would die on the invalid value)."""
    try:
        return msgspec.structs.replace(
            params,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            logit_bias=dict(params.logit_bias),
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{field}.{exc}") from None


def check_fits(
    num_prompt_tokens: int,
    max_new_tokens: int,
    max_context: int,
    pool_tokens: int,
    field: str,
) -> None:
    """The request must fit the model's context and, alone, the KV pool."""
    total = num_prompt_tokens + max_new_tokens
    if total > max_context:
        raise ContextLengthError(
            f"{field}: {num_prompt_tokens} prompt tokens + max_new_tokens {max_new_tokens} = "
            f"{total} exceeds the model's context of {max_context} tokens",
            field, num_prompt_tokens, max_new_tokens, max_context, of_pool=False,
        )
    if total > context_limit(max_context, pool_tokens):  # the pool is the tighter bound
        raise ContextLengthError(
            f"{field}: {num_prompt_tokens} prompt tokens + max_new_tokens {max_new_tokens} "
            f"need {total - 1} KV slots, more than the KV cache's {pool_tokens} "
            "(num_pages x page_size)",
            field, num_prompt_tokens, max_new_tokens, pool_tokens, of_pool=True,
        )


# Namespaces name tenants (an id, a hash); the tree keeps each as a key, so their size is bounded.
MAX_NAMESPACE_CHARS = 256


def check_namespace(namespace: Any) -> str | None:
    if namespace is not None and not isinstance(namespace, str):
        raise ValueError(f"namespace: expected str or None, got {type(namespace).__name__}")
    if namespace is not None and len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(
            f"namespace: {len(namespace)} characters, more than the limit of "
            f"{MAX_NAMESPACE_CHARS} (hash longer tenant names)"
        )
    if namespace is not None:
        check_text(namespace, "namespace")
    return namespace
