"""The one boundary of an engine's model: what callers pass (text, token ids, chat messages,
``PromptIds``; sampling parameters; a namespace) to checked token ids and parameters.

Everything is checked here, in the caller's thread, before anything is queued, and in one
walk per call: the namespace, the prompts, one ``SamplingParams`` per prompt (the engine's
own copy, validated again), then per prompt its ids, their kept tail
(``truncate_prompt_tokens``), the fit to the context and the pool, and the structured output
it asks for. Every check raises ValueError with a message that names the field and the limit,
so a caller can fix the request without reading our code. An ``Engine`` and a front end that
sends ids to replicas (``cluster.remote.RemoteEngine``) each hold a ``PromptPreparer``, so
both check the same things in the same words.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from engine.api import ContextLengthError, PromptIds, context_limit
from engine.model.structured import Grammars
from engine.serving.conversation import (
    check_text,
    continue_conversation,
    encode_conversation,
)
from scheduler import SamplingParams
from scheduler.params import check_truncate_prompt_tokens

# Namespaces name tenants (an id, a hash); the tree keeps each as a key, so their size is bounded.
MAX_NAMESPACE_CHARS = 256

Prepared = list[tuple[list[int], SamplingParams]]
IdsT = TypeVar("IdsT", bound=list[int])


class PromptPreparer:
    """The one validation boundary of a model (see the module docstring). ``pool_tokens``,
    given per call, is what one request may hold of the KV pool (``num_pages x
    page_size``; a front end's replicas may not have reported theirs yet)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_context: int, grammars: Grammars | None = None,
        *, priority_scheduling: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        # False (an engine scheduling first come, first served): a priority other than 0 is
        # refused here, in the caller's thread. True: allowed (a front whose replicas' own
        # engines check it again).
        self.priority_scheduling = priority_scheduling
        # Structured outputs are compiled (once per distinct spec) when a request comes in.
        self.grammars = grammars if grammars is not None else Grammars(tokenizer)

    def prepare(
        self, prompts: Any, params: Any, namespace: Any, pool_tokens: int, single: bool = False
    ) -> Prepared:
        """Every prompt's ids and parameters, all checked before any is queued; each must fit
        the context and, alone, a pool of ``pool_tokens``. ``single``: exactly one prompt."""
        check_namespace(namespace)
        items = split_prompts(prompts)
        if single and len(items) != 1:
            raise ValueError(f"prompt: expected one prompt, got a list of {len(items)}")
        params_list = check_params(params, len(items), self.vocab_size)
        self._check_priority(params_list)
        fields = ["prompt"] if len(items) == 1 else [f"prompts[{i}]" for i in range(len(items))]
        ids = [self._encode(item, field) for item, field in zip(items, fields)]
        return self._with_params(ids, fields, params_list, pool_tokens)

    def prepare_fork(
        self, prefix: Any, suffixes: Any, params: Any, namespace: Any, pool_tokens: int
    ) -> Prepared:
        """``Engine.fork``'s requests: the prefix's ids followed by each suffix's, every
        suffix encoded alone (no special tokens added), so each request starts with exactly
        the prefix's tokens."""
        check_namespace(namespace)
        if isinstance(prefix, str):
            if not prefix:
                raise ValueError("prefix: empty prefix; it needs at least one token")
            prefix_ids = self._text_ids(prefix, "prefix")
        else:
            prefix_ids = self._encode(prefix, "prefix")
        if isinstance(suffixes, str) or not isinstance(suffixes, Sequence):
            raise ValueError("suffixes: expected a list of str or token-id lists")
        if len(suffixes) == 0:
            raise ValueError("suffixes: empty list; expected at least one suffix")
        params_list = check_params(params, len(suffixes), self.vocab_size)
        self._check_priority(params_list)
        prompts: list[list[int]] = []
        for i, suffix in enumerate(suffixes):
            field = f"suffixes[{i}]"
            if isinstance(suffix, str):
                ids = self._text_ids(suffix, field, add_special_tokens=False) if suffix else []
            elif isinstance(suffix, Sequence):
                ids = check_token_ids(suffix, self.vocab_size, field) if len(suffix) else []
            else:
                raise ValueError(f"{field}: expected str or token ids, got {type(suffix).__name__}")
            prompts.append(prefix_ids + ids)
        fields = ["prompt"] if len(prompts) == 1 else [f"prompts[{i}]" for i in range(len(prompts))]
        return self._with_params(prompts, fields, params_list, pool_tokens)

    def encode(
        self,
        prompt: Any,
        field: str = "prompt",
        truncate_prompt_tokens: int | None = None,
        pool_tokens: int | None = None,
        continuing: Sequence[int] | None = None,
    ) -> PromptIds:
        """Exactly one prompt's checked token ids, their last ``truncate_prompt_tokens``
        (-1: what the context, the model's or a pool of ``pool_tokens``, holds); ValueError
        names ``field``. ``continuing``: a conversation's earlier turn as the engine ran it
        (its prompt and reply ids); ``prompt`` (chat messages) extends it, and its ids are
        kept verbatim as far as the rendered conversation agrees with them, as
        ``ChatSession`` does: a reply re-tokenised could split otherwise and miss the cache."""
        if continuing:
            ids, _ = continue_conversation(self.tokenizer, continuing, prompt, field)
            ids = PromptIds(check_token_ids(ids, self.vocab_size, field))
        else:
            items = split_prompts(prompt)
            if len(items) != 1:
                raise ValueError(f"{field}: expected one prompt, got a list of {len(items)}")
            ids = PromptIds(self._encode(items[0], field))
        if truncate_prompt_tokens is None:
            return ids
        return kept_prompt(ids, truncate_prompt_tokens, self.context(pool_tokens))

    def _check_priority(self, params_list: list[SamplingParams]) -> None:
        """vLLM's rule: a priority only where the engine schedules by it, so no client can
        place itself ahead of the others on a server that did not ask for that."""
        if self.priority_scheduling:
            return
        for i, p in enumerate(params_list):
            if p.priority:
                field = "params" if len(params_list) == 1 else f"params[{i}]"
                raise ValueError(
                    f"{field}.priority: {p.priority} needs priority scheduling, which this "
                    "engine does not do (start it with scheduling_policy=\"priority\", the "
                    "server with --scheduling-policy priority); only 0 is accepted"
                )

    def context(self, pool_tokens: int | None) -> int:
        """Prompt + generated tokens one request may hold (``context_limit``)."""
        return context_limit(self.max_context, pool_tokens)

    def _with_params(
        self,
        ids: list[list[int]],
        fields: list[str],
        params_list: list[SamplingParams],
        pool_tokens: int,
    ) -> Prepared:
        """Each prompt with its (checked) params: its kept tail and its fit, then the
        structured outputs they ask for, each distinct one compiled once."""
        context = self.context(pool_tokens)  # what -1 keeps, as ``encode``'s
        prepared: Prepared = []
        for prompt_ids, p, field in zip(ids, params_list, fields):
            prompt_ids = kept_prompt(prompt_ids, p.truncate_prompt_tokens, context)
            check_fits(len(prompt_ids), p.max_new_tokens, self.max_context, pool_tokens, field)
            prepared.append((prompt_ids, p))
        checked: set[int] = set()
        for i, p in enumerate(params_list):
            if p.structured_outputs is not None and id(p) not in checked:
                where = "params" if len(params_list) == 1 else f"params[{i}]"
                self.grammars.check(p.structured_outputs, f"{where}.structured_outputs")
                checked.add(id(p))
        return prepared

    def _encode(self, prompt: Any, field: str) -> list[int]:
        """Token ids of one prompt; ValueError naming ``field`` when it is empty or malformed.
        ``PromptIds`` were encoded and checked already: they are taken as they are."""
        if isinstance(prompt, PromptIds):
            if not prompt:
                raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
            return prompt
        prompt = _as_python(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
            return self._text_ids(prompt, field, add_special_tokens=True)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            if len(prompt) == 0:
                raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
            if isinstance(prompt[0], Mapping):
                ids = encode_conversation(self.tokenizer, prompt, field)
                return check_token_ids(ids, self.vocab_size, field)
            return check_token_ids(prompt, self.vocab_size, field)
        raise ValueError(
            f"{field}: expected str, token ids or chat messages, got {type(prompt).__name__}"
        )

    def _text_ids(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, field)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return check_token_ids(ids, self.vocab_size, field)


def split_prompts(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts (in input order).

    A str, a list of ints and a list of messages are each ONE prompt; a list of those is many.
    """
    if isinstance(prompts, PromptIds):
        return [prompts]
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


def is_conversation(prompt: Any) -> bool:
    """Whether one prompt (an item of ``split_prompts``) is a list of chat messages."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping)


def _as_python(value: Any) -> Any:
    """numpy arrays and tensors of token ids -> lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def kept_prompt(ids: IdsT, keep: int | None, context: int) -> IdsT:
    """The prompt as ``truncate_prompt_tokens`` keeps it: its last ``keep`` tokens (-1: what
    ``context`` holds: ``context_limit`` of the model and the pool, for every caller), as the
    same kind of list (``PromptIds`` stay checked ids). The one place a prompt is cut."""
    check_truncate_prompt_tokens(keep)
    if keep is None:
        return ids
    keep = context if keep == -1 else keep
    return ids if len(ids) <= keep else type(ids)(ids[-keep:])


# ------------------------------------------------------------------------------ field checks


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
