"""Trace records and their JSONL files.

A trace is a set of sessions. A session is a closed loop of turns: turn k+1 is sent only after
the reply to turn k came back, and carries that reply (chat history, agent trajectory). A
single-request workload (RAG, shared prefix, few-shot, unique) is a session of one turn.
Shared documents are stored once and referenced by id; a turn's ``branches`` are candidate
continuations forked from the same state (an agent's tree), whose replies are not carried on.

File layout: one JSON object per line, tagged by ``kind``: a ``header``, then ``document``
lines, then ``session`` lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

TEMPLATES = ("chat", "raw")


class Turn(msgspec.Struct, frozen=True, omit_defaults=True):
    """One user message and how much the model may answer.

    ``think_s``: seconds the user waits after the previous reply before sending this turn.
    ``branches``: texts appended to this turn's prompt (after the assistant header), each a
    candidate forked from the same state; run alongside the turn, their replies are dropped.
    ``ignore_eos``: generate exactly ``max_new_tokens`` (benchmarks with fixed output lengths).
    """

    user: str
    max_new_tokens: int
    think_s: float = 0.0
    branches: tuple[str, ...] = ()
    ignore_eos: bool = False


class Session(msgspec.Struct, frozen=True, omit_defaults=True):
    """A conversation or task: a system prompt, shared documents, and its turns.

    ``template``: "chat" applies the model's chat template (system message = system prompt and
    documents); "raw" concatenates system, documents and user text as plain tokens, each part
    tokenised on its own so that equal parts give equal token ids.
    """

    id: str
    turns: tuple[Turn, ...]
    system: str = ""
    documents: tuple[str, ...] = ()
    arrival_s: float = 0.0
    template: Literal["chat", "raw"] = "chat"


class Header(msgspec.Struct, frozen=True, tag_field="kind", tag="header"):
    workload: str
    seed: int
    params: dict[str, Any] = {}


class Document(msgspec.Struct, frozen=True, tag_field="kind", tag="document"):
    id: str
    text: str


class SessionLine(msgspec.Struct, frozen=True, tag_field="kind", tag="session"):
    session: Session


Line = Header | Document | SessionLine


class Trace(msgspec.Struct, frozen=True):
    """A whole workload: what was generated (workload, seed, params) and its sessions."""

    workload: str
    seed: int
    params: dict[str, Any]
    documents: dict[str, str]
    sessions: tuple[Session, ...]

    def __post_init__(self) -> None:
        for session in self.sessions:
            validate_session(session, self.documents)

    @property
    def num_requests(self) -> int:
        """Requests the trace sends: every turn and every branch."""
        return sum(1 + len(t.branches) for s in self.sessions for t in s.turns)


def validate_session(session: Session, documents: dict[str, str]) -> None:
    if not session.turns:
        raise ValueError(f"session {session.id!r}: turns must not be empty")
    if session.template not in TEMPLATES:
        raise ValueError(f"session {session.id!r}: template must be one of {TEMPLATES}")
    if session.arrival_s < 0:
        raise ValueError(f"session {session.id!r}: arrival_s must be >= 0")
    for doc in session.documents:
        if doc not in documents:
            raise ValueError(f"session {session.id!r}: document {doc!r} is not in the trace")
    for turn in session.turns:
        if turn.max_new_tokens < 1:
            raise ValueError(f"session {session.id!r}: max_new_tokens must be >= 1")
        if turn.think_s < 0:
            raise ValueError(f"session {session.id!r}: think_s must be >= 0")


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Line)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as JSONL (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for line in _lines(trace):
            f.write(_encoder.encode(line))
            f.write(b"\n")


def _lines(trace: Trace) -> list[Line]:
    out: list[Line] = [Header(trace.workload, trace.seed, trace.params)]
    out.extend(Document(doc_id, text) for doc_id, text in trace.documents.items())
    out.extend(SessionLine(s) for s in trace.sessions)
    return out


def read_trace(path: str | Path) -> Trace:
    """Read a trace written by :func:`write_trace`; malformed lines raise ValueError."""
    header: Header | None = None
    documents: dict[str, str] = {}
    sessions: list[Session] = []
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = _decoder.decode(raw)
            except msgspec.DecodeError as exc:
                raise ValueError(f"trace line {number}: {exc}") from exc
            if isinstance(line, Header):
                if header is not None:
                    raise ValueError(f"trace line {number}: a second header")
                header = line
            elif isinstance(line, Document):
                documents[line.id] = line.text
            else:
                sessions.append(line.session)
    if header is None:
        raise ValueError(f"trace {str(path)!r}: header line is missing")
    return Trace(header.workload, header.seed, header.params, documents, tuple(sessions))
