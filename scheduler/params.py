"""What a request asks for: how many tokens, how to pick them, when to stop.

A frozen record validated once, when it is made: the engine's callers build it, the scheduler
reads its limits, the sampler its knobs, all from the same object (vLLM's SamplingParams,
whose habits it follows). Pure Python, so the scheduler stays free of torch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import msgspec

_SEED_LIMIT = 1 << 63
# Temperatures below this are greedy: dividing logits by them overflows float32 (vLLM's rule).
GREEDY_BELOW = 1e-5
# Most alternatives a request may ask log-probabilities for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# OpenAI's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# Priorities in [-PRIORITY_LIMIT, PRIORITY_LIMIT]: a bounded number of queue levels, and a
# bounded wait behind better ones (the gap x ``priority_aging_seconds``).
PRIORITY_LIMIT = 1000


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match (vLLM's names); exactly one of: ``json`` (a JSON schema, as a
    dict or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (a Lark grammar, llguidance's dialect). Checked for shape here;
    the engine compiles it (once per distinct one) when the request is submitted."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json: expected a JSON schema, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice: expected a list of non-empty strings, got "
                f"{self.choice!r}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object: expected a bool")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))


KINDS = ("json", "json_object", "regex", "choice", "grammar")


def check_truncate_prompt_tokens(k: object) -> None:
    """``truncate_prompt_tokens``' one rule, for the params and for ``encode``, which keeps a
    prompt's tail where a front end needs the kept ids before it builds the params."""
    if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
        raise ValueError(
            f"truncate_prompt_tokens: must be None, an integer >= 1 or -1 (what the context "
            f"holds), got {k!r}"
        )


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick tokens for one request. ``temperature=0`` is greedy; ``top_k=0`` is off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    # The stop string that ended the output stays in its text (vLLM's); it is cut by default.
    include_stop_str_in_output: bool = False
    # Special tokens (<|im_end|>, ...) are left out of the text (vLLM's default).
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Tokens generated before EOS, a stop token or a stop string may end the request (vLLM's):
    # until then those tokens are masked and stop strings are not looked for.
    min_tokens: int = 0
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely tokens'.
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it, and
    # the k most likely tokens there (vLLM's ``prompt_logprobs``; OpenAI's echo with logprobs).
    # Such a prompt is computed whole: a cached prefix has K/V but no logits.
    prompt_logprobs: int | None = None
    # Penalties as vLLM defines them, on the logits before temperature and filters: presence
    # subtracts its value from every token generated so far, frequency its value times the
    # token's count in the output; repetition divides a positive logit (multiplies a negative
    # one) of every token seen in the prompt or the output. ``logit_bias`` adds its value to a
    # token's logit (OpenAI's; -100 bans it in practice, 100 nearly forces it).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # Keep only the prompt's last k tokens (vLLM's; -1: as many as the context holds, the
    # model's or the KV pool's where less, which leaves no room to generate): with k = context - max_new_tokens, a chat
    # that outgrew the context goes on without its oldest turns.
    truncate_prompt_tokens: int | None = None
    # The output must match this (a JSON schema, a regex, ...): every step's logits are
    # masked to the tokens it allows, and EOS only where it is complete.
    structured_outputs: StructuredOutputsParams | None = None
    # Lower runs first (vLLM's meaning), in [-1000, 1000]; only where the engine schedules by
    # priority (``scheduling_policy="priority"``), else it must be 0. Admission by priority,
    # then the queue's own order; preemption takes the worst priority first. Waiting ages it:
    # one step of priority per ``priority_aging_seconds`` waited.
    priority: int = 0

    def __post_init__(self) -> None:
        # vLLM's spellings: one stop string as a str, top_k -1 for off.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        if self.top_k == -1 and _is_int(self.top_k):
            msgspec.structs.force_setattr(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k: must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise ValueError(f"seed: must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids: must be a list of integers >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens: must be a bool, got {self.skip_special_tokens!r}"
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                "include_stop_str_in_output: must be a bool, got "
                f"{self.include_stop_str_in_output!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens: must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs: must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs: must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name}: must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty: must be a number in (0, 10] (1 = off), got "
                f"{self.repetition_penalty!r}"
            )
        self._check_logit_bias()
        if not _is_int(self.priority) or not -PRIORITY_LIMIT <= self.priority <= PRIORITY_LIMIT:
            raise ValueError(
                f"priority: must be an integer in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}] (lower "
                f"runs first), got {self.priority!r}"
            )
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs: expected StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens: not supported with structured outputs or tools (a grammar "
                "decides where the output may end)"
            )

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias: must be a dict of token id -> bias, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias: {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS_ENTRIES}"
            )
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids >= 0, got {token!r}")
            if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{token}]: must be a number in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {value!r}"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a logit bias changes this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def penalises_prompt(self) -> bool:
        """The repetition penalty reads the prompt's tokens too (the others the output's)."""
        return self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or so close to it that scaling by it would overflow."""
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    """Any integral number (numpy's too), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite number (numpy's too), never a bool."""
    return _is_int(value) or (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    )
