"""Drive an OpenAI-compatible server over HTTP with a trace: what ``serve_bench`` measures.

Every request is ``POST /v1/completions`` with the prompt as token ids, so two servers (ours and
vLLM) see exactly the same tokens; replies are streamed (SSE, parsed here by hand) so that the
time to the first token and every gap between tokens can be measured at the client, as a user
of the server would see them. Sessions arrive as a Poisson process (or all at once); a
multi-turn session is a closed loop: turn k+1's prompt is turn k's prompt + the reply token ids
the server returned + the next user turn (workloads.traces.prompts), so its prefix is what the server
cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from workloads.traces.prompts import SessionPrompts
from workloads.traces.text import encode
from workloads.traces.tokenizer import TextTokenizer
from workloads.traces.trace import Session, Trace

DONE = "[DONE]"
ISOLATION = ("prefix", "cache-salt", "none")


class RequestResult(msgspec.Struct):
    """One request as the client saw it. Times in seconds; ``sent_s`` from the run's start.

    ``itl_s``: one gap per generated token after the first (a chunk of n tokens arriving g
    seconds after the previous chunk adds n gaps of g/n). ``cached_tokens`` None: the server
    did not say (vLLM says only with ``--enable-prompt-tokens-details``). ``ids_from``:
    "server" (return_token_ids) or "text" (the reply text re-tokenised here).
    """

    session: str
    turn: int
    branch: int  # -1: the turn itself, else the branch index
    sent_s: float
    prompt_hash: str  # to pair the same request across servers
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = []
    output_ids: list[int] = []
    ids_from: str = "server"
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (0 for a one-token reply)."""
        if self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class RunRecord(msgspec.Struct):
    """One run: a request rate (inf: all at once), one repeat, every request in send order."""

    rate: float
    repeat: int
    max_concurrency: int | None
    duration_s: float
    requests: list[RequestResult]


class ServerInfo(msgspec.Struct):
    url: str
    model: str
    returns_token_ids: bool
    reports_cached_tokens: bool


class SSEDecoder:
    """Server-sent events by hand: ``data:`` lines are joined until a blank line ends the event.

    Servers send one ``data: {json}`` line per event; comments (``:``) and other fields
    (``event:``, ``id:``) are ignored. ``feed`` returns the event's data when one is complete.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (at a blank line, or when the stream ends), if any."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def parse_event(data: str) -> dict[str, Any] | str:
    """An event's JSON object, or :data:`DONE`. Raises ValueError on anything else."""
    if data.strip() == DONE:
        return DONE
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad SSE data {data[:80]!r}: {exc}") from exc
    if not isinstance(chunk, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
    return chunk


def prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.blake2b(msgspec.json.encode(list(ids)), digest_size=8).hexdigest()


class _Stream:
    """The state of one streamed reply while its chunks come in."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.last: float | None = None
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.ids: list[int] = []
        self.text: list[str] = []
        self.chunks = 0  # chunks that carried tokens
        self.ids_missing = False
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            raise ValueError(f"server error in stream: {str(chunk['error'])[:200]}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            text = choice.get("text") or ""
            ids = choice.get("token_ids")
            if ids is None:
                count = 1 if text else 0
                self.ids_missing = self.ids_missing or bool(text)
            else:
                count = len(ids)
                self.ids.extend(ids)
            self.text.append(text)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            if count:
                self._tokens(count, now)

    def _tokens(self, count: int, now: float) -> None:
        self.chunks += 1
        if self.ttft is None:
            self.ttft = now - self.started
            count -= 1  # the first token has no gap before it; the rest of its chunk came free
            self.itl.extend([0.0] * count)
        else:
            gap = now - (self.last if self.last is not None else self.started)
            self.itl.extend([gap / count] * count)
        self.last = now


def _cached(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


class Client:
    """An OpenAI-compatible server's ``/v1/completions``, streamed, with token-id prompts."""

    def __init__(
        self,
        http: Any,
        model: str,
        tokenizer: TextTokenizer,
        trace_eos: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.http = http
        self.model = model
        self.tokenizer = tokenizer
        self.trace_eos = trace_eos
        self.extra = dict(extra or {})

    def body(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> bytes:
        return msgspec.json.encode(
            {
                "model": self.model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": ignore_eos or not self.trace_eos,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
                **self.extra,
            }
        )

    async def complete(
        self, result: RequestResult, prompt: Sequence[int], max_tokens: int, ignore_eos: bool
    ) -> str:
        """Send one request, fill ``result`` in; returns the reply text. Never raises."""
        body = self.body(prompt, max_tokens, ignore_eos)  # encoded before the clock starts
        started = time.perf_counter()
        state = _Stream(started)
        try:
            async with self.http.stream(
                "POST",
                "/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
            ) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode("utf-8", "replace")
                    raise ValueError(f"HTTP {reply.status_code}: {text[:300]}")
                decoder = SSEDecoder()
                async for line in reply.aiter_lines():
                    data = decoder.feed(line)
                    if data is not None and self._event(state, data):
                        break
                else:
                    data = decoder.flush()
                    if data is not None:
                        self._event(state, data)
            result.e2e_s = time.perf_counter() - started
            if state.ttft is None:
                raise ValueError("the stream ended without a token")
        except Exception as exc:  # noqa: BLE001 - every failure is a failed request
            result.error = f"{type(exc).__name__}: {exc}"[:500]
        self._fill(result, state)
        return "".join(state.text)

    def _event(self, state: _Stream, data: str) -> bool:
        chunk = parse_event(data)
        if chunk == DONE:
            return True
        assert isinstance(chunk, dict)
        state.on_chunk(chunk, time.perf_counter())
        return False

    def _fill(self, result: RequestResult, state: _Stream) -> None:
        usage = state.usage or {}
        result.ttft_s = state.ttft
        result.itl_s = state.itl
        result.finish_reason = state.finish
        result.cached_tokens = _cached(state.usage)
        if usage.get("prompt_tokens") is not None:
            result.prompt_tokens = int(usage["prompt_tokens"])
        text = "".join(state.text)
        if state.ids_missing or (not state.ids and text):
            result.ids_from = "text"
            result.output_ids = encode(self.tokenizer, text)
        else:
            result.output_ids = state.ids
        counted = len(state.ids) if state.ids else state.chunks
        result.output_tokens = int(usage.get("completion_tokens") or counted)


async def server_model(http: Any) -> str:
    """The first model ``GET /v1/models`` lists."""
    reply = await http.get("/v1/models")
    reply.raise_for_status()
    models = reply.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models lists no model")
    return str(models[0]["id"])


def session_starts(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times of ``count`` sessions at ``rate`` per second (inf: all at 0).

    The same seed gives the same unit-rate gaps at every rate, scaled by 1/rate, so runs at
    different rates send the same pattern, compressed.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


class RunSpec(msgspec.Struct, frozen=True):
    """How one run sends the trace. ``salt``: token ids put before every prompt so that this
    run shares no prefix with an earlier run on the same server (empty: none)."""

    rate: float
    repeat: int = 0
    max_concurrency: int | None = None
    seed: int = 0
    salt: tuple[int, ...] = ()


async def run_trace(
    client: Client,
    trace: Trace,
    spec: RunSpec,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunRecord:
    """Send every session of ``trace`` as ``spec`` says; returns when every reply is back."""
    limit = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    starts = session_starts(len(trace.sessions), spec.rate, spec.seed)
    results: list[RequestResult] = []
    started = time.perf_counter()

    async def send(
        result: RequestResult, prompt: list[int], max_tokens: int, ignore_eos: bool
    ) -> str:
        if limit is None:
            text = await client.complete(result, prompt, max_tokens, ignore_eos)
        else:
            async with limit:
                result.sent_s = time.perf_counter() - started
                text = await client.complete(result, prompt, max_tokens, ignore_eos)
        if on_done is not None:
            on_done(result)
        return text

    async def session(s: Session, start: float) -> None:
        await asyncio.sleep(max(0.0, started + start - time.perf_counter()))
        prompts = SessionPrompts(s, trace, client.tokenizer)
        for index, turn in enumerate(s.turns):
            if turn.think_s:
                await asyncio.sleep(turn.think_s)
            prompt = prompts.prompt()
            batch = [prompt, *prompts.branch_prompts(prompt)]
            sent = time.perf_counter() - started
            mine = []
            for branch, ids in enumerate(batch):
                full = [*spec.salt, *ids]
                mine.append(
                    RequestResult(s.id, index, branch - 1, sent, prompt_hash(ids), len(full))
                )
                results.append(mine[-1])  # send order
            texts = await asyncio.gather(
                *(
                    send(r, [*spec.salt, *ids], turn.max_new_tokens, turn.ignore_eos)
                    for r, ids in zip(mine, batch)
                )
            )
            if not mine[0].ok:
                return  # the session cannot go on without its reply
            prompts.record_reply(prompt, mine[0].output_ids, texts[0])

    await asyncio.gather(*(session(s, t) for s, t in zip(trace.sessions, starts)))
    duration = time.perf_counter() - started
    return RunRecord(spec.rate, spec.repeat, spec.max_concurrency, duration, results)


def run_salt(tokenizer: TextTokenizer, rng: random.Random, digits: int = 8) -> tuple[int, ...]:
    """A short token prefix unique to one run (random digits, each its own token id), so that
    runs against one long-lived server do not hit each other's cache; same length every run."""
    digit_ids = [encode(tokenizer, str(d)) for d in range(10)]
    if any(len(ids) != 1 for ids in digit_ids):  # a tokenizer that merges digits: use text
        return tuple(encode(tokenizer, f"run {rng.getrandbits(32):08x}\n"))
    head = encode(tokenizer, "run")
    tail = encode(tokenizer, "\n")
    return (*head, *(digit_ids[rng.randrange(10)][0] for _ in range(digits)), *tail)


def make_http(url: str, timeout_s: float, api_key: str | None = None) -> Any:
    """An ``httpx.AsyncClient`` with no pool limit (a limit would queue requests in the client
    and count the wait as server latency) and a read timeout per chunk."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def probe(client: Client, tokenizer: TextTokenizer) -> tuple[bool, bool]:
    """One tiny request before the runs: the server works, and does it return token ids and
    cached tokens? Its prompt shares nothing with the trace (no warm cache for the runs)."""
    result = RequestResult("probe", 0, -1, 0.0, "", 0)
    await client.complete(result, encode(tokenizer, "Warm-up: say hello."), 2, True)
    if result.error:
        raise RuntimeError(f"the server failed a first request: {result.error}")
    return result.ids_from == "server", result.cached_tokens is not None
