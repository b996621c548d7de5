"""From what callers pass (text, token ids, chat messages) to the token ids of a prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from engine.api import PromptIds, context_limit
from engine.model.structured import Grammars
from engine.serving.validation import (
    check_fits,
    check_messages,
    check_namespace,
    check_params,
    check_text,
    check_token_ids,
    is_token_id,
)
from scheduler import SamplingParams
from scheduler.params import check_truncate_prompt_tokens

# One prompt: text, token ids, or a conversation [{"role": ..., "content": ...}, ...].
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


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


# A span of text [start, end) that came from a caller: it is encoded as plain text.
Span = tuple[int, int]


def render_messages(tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str) -> str:
    """The conversation as text, ready for the assistant's reply (the model's chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{field}: chat messages need a chat template; this model has none")
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True
    )


def render_with_spans(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str
) -> tuple[str, list[Span]]:
    """The rendered conversation and where each message's content lies in it.

    Only the template's own markers may become control tokens: a user who types
    ``<|im_end|><|im_start|>system`` in a message must not forge a system turn. The contents
    are found by rendering the template once more with placeholders in their place (exact,
    whatever text the template puts around them); a template that rewrites contents falls
    back to finding them in order.
    """
    text = render_messages(tokenizer, messages, field)
    check_roles(tokenizer, messages, field)
    marks = [f"\x00radixkv-content-{i}\x00" for i in range(len(messages))]
    stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    skeleton = render_messages(tokenizer, stand_ins, field)
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


def check_roles(tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str) -> None:
    """A role is the template's business: it may not carry special tokens either."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    for i, message in enumerate(messages):
        for token in specials:
            if token in message["role"]:
                raise ValueError(f"{field}[{i}].role: contains the special token {token!r}")


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
        tail = encode_text(tokenizer, rest, add_special_tokens=False) if rest else []
    else:
        shifted = [(max(s - offset, 0), e - offset) for s, e in spans if e > offset]
        tail = encode_with_spans(tokenizer, rest, shifted)
    return previous[:keep] + tail, keep


def encode_text(
    tokenizer: Any, text: str, add_special_tokens: bool = True, field: str = "prompt"
) -> list[int]:
    check_text(text, field)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_prompt(tokenizer: Any, prompt: Any, vocab_size: int, field: str) -> list[int]:
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
        return check_token_ids(encode_text(tokenizer, prompt, field=field), vocab_size, field)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if len(prompt) == 0:
            raise ValueError(f"{field}: empty prompt; a prompt needs at least one token")
        if isinstance(prompt[0], Mapping):
            messages = check_messages(prompt, field)
            # The template writes the special tokens itself (BOS included where it has one);
            # the contents are text, whatever they look like.
            text, spans = render_with_spans(tokenizer, messages, field)
            return check_token_ids(encode_with_spans(tokenizer, text, spans), vocab_size, field)
        return check_token_ids(prompt, vocab_size, field)
    raise ValueError(
        f"{field}: expected str, token ids or chat messages, got {type(prompt).__name__}"
    )


def _as_python(value: Any) -> Any:
    """numpy arrays and tensors of token ids -> lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def encode_one(tokenizer: Any, prompt: Any, vocab_size: int, field: str = "prompt") -> PromptIds:
    """Token ids of exactly one prompt, checked; ValueError names ``field``."""
    items = split_prompts(prompt)
    if len(items) != 1:
        raise ValueError(f"{field}: expected one prompt, got a list of {len(items)}")
    return PromptIds(encode_prompt(tokenizer, items[0], vocab_size, field))


IdsT = TypeVar("IdsT", bound=list[int])


def kept_prompt(ids: IdsT, keep: int | None, context: int) -> IdsT:
    """The prompt as ``truncate_prompt_tokens`` keeps it: its last ``keep`` tokens (-1: what
    ``context`` holds: ``context_limit`` of the model and the pool, for every caller), as the
    same kind of list (``PromptIds`` stay checked ids). The one place a prompt is cut: the
    boundary's ``prepare`` for a request's params, ``encode`` for a front end that needs the
    kept ids before it builds the params (the server's budget, echo, ``prompt_token_ids``)."""
    check_truncate_prompt_tokens(keep)
    if keep is None:
        return ids
    keep = context if keep == -1 else keep
    return ids if len(ids) <= keep else type(ids)(ids[-keep:])


def prepare_prompts(
    tokenizer: Any,
    vocab_size: int,
    max_context: int,
    pool_tokens: int,
    prompts: Any,
    params: Any,
    namespace: Any,
    single: bool = False,
) -> list[tuple[list[int], SamplingParams]]:
    """Every prompt's token ids and sampling parameters, all validated before any is run:
    the one boundary, for an Engine and for a front end that sends ids to replicas."""
    check_namespace(namespace)
    items = split_prompts(prompts)
    if single and len(items) != 1:
        raise ValueError(f"prompt: expected one prompt, got a list of {len(items)}")
    params_list = check_params(params, len(items), vocab_size)
    context = context_limit(max_context, pool_tokens)  # what -1 keeps, as ``encode``'s
    prepared = []
    for i, (item, p) in enumerate(zip(items, params_list)):
        field = "prompt" if len(items) == 1 else f"prompts[{i}]"
        ids = encode_prompt(tokenizer, item, vocab_size, field)
        ids = kept_prompt(ids, p.truncate_prompt_tokens, context)
        check_fits(len(ids), p.max_new_tokens, max_context, pool_tokens, field)
        prepared.append((ids, p))
    return prepared


class PromptPreparer:
    """The one validation boundary of a model: what callers pass (text, ids, messages,
    ``PromptIds``; sampling parameters; a namespace) to checked token ids and parameters. An
    ``Engine`` and a front end that sends ids to replicas (``cluster.remote.RemoteEngine``)
    each hold one, so both check the same things in the same words."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_context: int, grammars: Grammars | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        # Structured outputs are compiled (once per distinct spec) when a request comes in.
        self.grammars = grammars if grammars is not None else Grammars(tokenizer)

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
            messages = check_messages(prompt, field)
            text, spans = render_with_spans(self.tokenizer, messages, field)
            ids, _ = continue_tokens(self.tokenizer, continuing, text, spans)
            ids = PromptIds(check_token_ids(ids, self.vocab_size, field))
        else:
            ids = encode_one(self.tokenizer, prompt, self.vocab_size, field)
        if truncate_prompt_tokens is None:
            return ids
        context = context_limit(self.max_context, pool_tokens)
        return kept_prompt(ids, truncate_prompt_tokens, context)

    def prepare(
        self, prompts: Any, params: Any, namespace: Any, pool_tokens: int, single: bool = False
    ) -> list[tuple[list[int], SamplingParams]]:
        """Every prompt's ids and parameters, all checked before any is queued; each must fit
        the context and, alone, a pool of ``pool_tokens``."""
        prepared = prepare_prompts(
            self.tokenizer, self.vocab_size, self.max_context, pool_tokens,
            prompts, params, namespace, single,
        )
        checked: set[int] = set()
        for i, (_, p) in enumerate(prepared):
            if p.structured_outputs is not None and id(p) not in checked:
                field = "params" if len(prepared) == 1 else f"params[{i}]"
                self.grammars.check(p.structured_outputs, f"{field}.structured_outputs")
                checked.add(id(p))
        return prepared
