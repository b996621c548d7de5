"""Structured outputs: a grammar per request that masks each step's logits to the tokens it
allows (llguidance).

Why llguidance: a small self-contained wheel (a Rust core, no torch or transformers pins; it
masks on the CPU in tens of microseconds per row and has rollback for speculation), where
xgrammar pulls triton and pinned transformers. One ``Grammars`` object per engine: it compiles
each distinct spec once (an LRU of grammar texts, validated against the tokenizer) and keeps a
matcher per running request. A row's mask reads only its own matcher, and masking sets
disallowed logits to -inf element-wise, so a constrained greedy answer is the same alone or
batched.

A grammar that llguidance cannot follow to its end is refused at submission, never
half-followed: llguidance reports limits lazily (a parser row over ``max_items_in_row``, an
Earley set over ``step_max_items``, a mask with no token at all) by putting the matcher in an
error state, whose mask allows EOS only, so the reply used to end "stop" with text outside
the grammar. ``check`` therefore walks the grammar's first steps (``_probe``) and refuses what
errs there; what errs later, mid-request, fails the request (``take_errors``), never "stop".
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from scheduler.params import StructuredOutputsParams

CACHE_SIZE = 256  # distinct grammars kept compiled
# Submission probe: masks computed along the grammar's forced path, and at its first branch
# the branches looked one token down (spread over the allowed tokens). Each mask costs tens of
# microseconds to a millisecond; the probe runs once per distinct spec (it is cached).
PROBE_MASKS = 64
PROBE_BRANCHES = 8


class GrammarError(ValueError):
    """llguidance stopped following a request's grammar mid-way (a limit it hit only there):
    the request fails with this rather than end with text outside the grammar."""


class Grammars:
    """Compiles structured-output specs for one tokenizer and masks logits by them."""

    def __init__(self, tokenizer: Any) -> None:
        self._hf_tokenizer = tokenizer
        self._tokenizer: Any = None  # llguidance's, built on first use (~0.4 s)
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # callers' threads check, the loop's thread masks
        self._matchers: weakref.WeakKeyDictionary[Any, _Matcher] = weakref.WeakKeyDictionary()
        self._executor: Any = None  # llguidance's thread pool for the rows' masks
        # Requests whose matcher erred in a mask since the last take_errors(): id -> message.
        self._errors: dict[int, str] = {}

    # ------------------------------------------------------------------- compiling

    def check(self, spec: StructuredOutputsParams, field: str = "structured_outputs") -> str:
        """The spec's grammar, compiled and validated (cached); ValueError naming the field
        when it cannot compile."""
        from llguidance import LLMatcher

        key = _key(spec)
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
                return grammar
        where = f"{field}.{spec.kind}"
        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            first = error.strip().splitlines()[0]
            raise ValueError(f"{where}: cannot compile: {first}")
        failure = _probe(LLMatcher(self.tokenizer, grammar, log_level=0), self.tokenizer)
        if failure is not None:
            raise ValueError(f"{where}: cannot be followed: {failure}")
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
        return self._tokenizer

    # ------------------------------------------------------------------- masking

    def mask(
        self, logits: torch.Tensor, spans: list[tuple[Any, Sequence[int], int]]
    ) -> torch.Tensor:
        """``logits`` with each constrained row's disallowed tokens at -inf, in a new tensor
        (the caller's logits stay the model's, for log-probabilities). ``spans`` holds each
        sampled entry's scheduler Request, its draft tokens and its first logits row: row
        ``first + j`` is masked as the grammar stands after the first ``j`` draft tokens. The
        request's output so far is fed to its matcher first (once each: a preempted and
        recomputed request's tokens are not fed again); the drafts are not (rolled back).

        Rows after a draft token the grammar refuses are left unconstrained: the row before
        them bans that token, so no draft past it is accepted and their samples are dropped.
        The rows' masks are computed together by llguidance's thread pool (the GIL released),
        into one bitmask unpacked with numpy; computing them on a thread beside the forward
        pass was no faster on 2 cores (``python -m workloads.model_bench.sampling_overhead``;
        docs/benchmarks.md)."""
        jobs: list[tuple[Any, int, list[int]]] = []
        rows: list[int] = []
        for request, draft, first in spans:
            if request.params.structured_outputs is None:
                continue
            llm = self._matcher(request).llm
            tokens = list(draft)
            valid = llm.validate_tokens(tokens) if tokens else 0
            jobs.append((llm, first, tokens[:valid]))
            rows.extend(range(first, first + valid + 1))
        if not jobs:
            return logits
        constrained = [r for r, _, _ in spans if r.params.structured_outputs is not None]
        vocab = self.tokenizer.vocab_size
        words = (vocab + 31) // 32
        bitmask = np.zeros((len(logits), words), dtype=np.int32)
        plain = [(llm, first) for llm, first, draft in jobs if not draft]
        drafted = [job for job in jobs if job[2]]  # llguidance refuses an empty draft list
        for call, batch in ((self.executor.unsafe_compute_mask_ptr, plain),
                            (self.executor.unsafe_compute_mask_ptr_with_draft_token, drafted)):
            if batch:
                call(batch, bitmask.ctypes.data, words * 4, len(logits))
        for request, (llm, _, _) in zip(constrained, jobs):
            if llm.is_error():  # its mask is EOS alone: the loop fails it instead
                self._errors[request.id] = (
                    f"structured_outputs: the grammar could not be followed after "
                    f"{len(request.output)} tokens: {_first_line(llm.get_error())}"
                )
        # Bit b of byte j of a row (little-endian words) is token 8 j + b.
        allowed = np.unpackbits(bitmask[rows].view(np.uint8), axis=1, bitorder="little")
        banned = np.zeros((len(logits), logits.shape[1]), dtype=bool)
        banned[rows, vocab:] = True  # model rows beyond the tokenizer's vocabulary
        banned[rows, :vocab] = ~allowed[:, :vocab].astype(bool)
        return logits.masked_fill(torch.from_numpy(banned).to(logits.device), float("-inf"))

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=max(1, os.cpu_count() or 1))
        return self._executor

    def take_errors(self) -> dict[int, str]:
        """The requests (by id) whose matcher erred in the masks since the last call, and
        why: their rows allowed EOS alone, so the caller fails them rather than take it."""
        errors, self._errors = self._errors, {}
        return errors

    def accept(self, given: list[tuple[Any, list[int]]]) -> None:
        """Feed each constrained request the tokens it was just given (its accepted drafts and
        the token sampled after them)."""
        for request, tokens in given:
            if request.params.structured_outputs is not None:
                matcher = self._matcher(request)
                for token in tokens:
                    matcher.feed(token)

    def _matcher(self, request: Any) -> _Matcher:
        matcher = self._matchers.get(request)
        if matcher is None:
            from llguidance import LLMatcher

            grammar = self.check(request.params.structured_outputs)
            matcher = _Matcher(LLMatcher(self.tokenizer, grammar, log_level=0))
            self._matchers[request] = matcher
        matcher.catch_up(request.output)
        return matcher


class _Matcher:
    """One request's llguidance matcher and how many of its output tokens it has consumed."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.fed = 0

    def catch_up(self, output: list[int]) -> None:
        if self.fed > len(output):  # the output was cut back: start over
            self.llm.reset()
            self.fed = 0
        for token in output[self.fed :]:
            self.feed(token)

    def feed(self, token: int) -> None:
        self.llm.consume_token(token)  # an error state masks to EOS only; never raises
        self.fed += 1


def _probe(matcher: Any, tokenizer: Any) -> str | None:
    """Why llguidance stops following the grammar within its first steps, or None. Walks the
    forced path (one token allowed besides EOS: every reply takes it) up to an accepting state
    or the first branch, and looks one token down a few branches there: a limit hit on those
    (a parser row of 2,001 alternatives is reached after one token; a grammar no finite
    string satisfies, ``start: "a" start``, grows its Earley sets past the limit while
    forcing) would be hit by replies. Bounded (``PROBE_MASKS``): a miss is caught mid-request
    by ``Grammars.mask``."""
    eos = tokenizer.eos_token
    budget = PROBE_MASKS
    while budget > 0:
        allowed = _allowed(matcher, tokenizer.vocab_size)
        budget -= 1
        if matcher.is_error():
            return _first_line(matcher.get_error())
        if matcher.is_accepting():
            return None
        tokens = allowed[allowed != eos]
        if len(tokens) == 1:
            matcher.consume_token(int(tokens[0]))
            continue
        step = max(1, len(tokens) // PROBE_BRANCHES)
        for token in tokens[::step][: min(PROBE_BRANCHES, budget)]:
            child = matcher.deep_copy()
            child.consume_token(int(token))
            child.compute_bitmask()
            if child.is_error():
                return _first_line(child.get_error())
        return None
    return None


def _allowed(matcher: Any, vocab: int) -> np.ndarray:
    """The token ids ``matcher``'s next mask allows."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")
    return np.flatnonzero(bits[:vocab])


def _first_line(error: str) -> str:
    """llguidance's message without the parser state it appends; its terms for a mask with
    no token allowed (no text satisfies the grammar from there) said in words."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if first in ("NoExtension", "NoExtensionBias"):
        return f"no text satisfies the grammar here (llguidance: {first})"
    return first


# How constrained JSON is laid out unless a schema's own "x-guidance" says otherwise: a space
# after ", " and ": " and no other whitespace (what tool calls are generated and rendered
# with). Left free, the 135M model spent its tokens on "\n\n:\n\n" between keys, and an
# object cut by max_tokens before it closed is no JSON at all.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def with_json_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``JSON_LAYOUT`` as its layout, unless it gives its own."""
    return {"x-guidance": JSON_LAYOUT, **schema}


def _key(spec: StructuredOutputsParams) -> str:
    value = getattr(spec, spec.kind)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return f"{spec.kind}:{text}"


def _grammar_text(spec: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher

    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict):
            raise ValueError("expected a JSON schema object")
        return LLMatcher.grammar_from_json_schema(with_json_layout(schema))
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema(with_json_layout({"type": "object"}))
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # One lexeme (an upper-case Lark rule: one regex) rather than a rule of alternatives,
        # which llguidance's parser bounds at 2,000 items per row (2,001 choices sharing a
        # first token erred after it). Lark string literals take JSON's escapes.
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, spec.choice))
        )
    return LLMatcher.grammar_from_lark(spec.grammar or "")
