"""A request as the scheduler sees it: token ids, limits, and where its KV lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestState(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and requeued)
    RUNNING = "running"      # admitted: holds pages, prefilling or decoding
    FINISHED = "finished"    # stop token, max_new_tokens, or finished by the engine (stop string)
    ABORTED = "aborted"      # aborted by the caller or failed; holds nothing


@dataclass(eq=False)
class Request:
    """One generation request.

    The scheduler owns every field below ``data``; the engine reads them and puts whatever it
    needs per request (sampling params, output sink, detokeniser) into ``data``, which the
    scheduler never looks at.
    """

    id: int | str
    prompt: list[int]
    max_new_tokens: int
    namespace: str | None = None
    stop_token_ids: frozenset[int] = frozenset()
    data: Any = None

    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    # Tokens served from the tree at first admission (what RequestOutput.cached_tokens reports).
    cached_tokens: int = 0
    # Tokens of prompt + output whose K/V is written in ``pages``.
    num_computed: int = 0
    # Page table: pages[i] holds tokens [i*p, (i+1)*p). Leading pages belong to the tree
    # (protected by the lock on ``node``), the rest are private to this request.
    pages: list[int] = field(default_factory=list)
    # The tree node this request holds a lock on (None: holds no lock).
    node: Any = None
    arrival: int = 0                      # arrival order, set by Scheduler.add
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None      # "stop", "length", "abort"
    num_preemptions: int = 0
    # Leading tokens of ``pages`` that belong to the tree (held by the lock on ``node``);
    # pages after them are private to this request. Always a multiple of the page size.
    tree_len: int = 0
    # Set at first admission: counters count a prompt (and its cached part) once.
    admitted: bool = False

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_prefilling(self) -> bool:
        """True while some prompt tokens (or, after preemption, output tokens) lack K/V."""
        return self.num_computed < self.num_tokens - (1 if self.output else 0)

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)
