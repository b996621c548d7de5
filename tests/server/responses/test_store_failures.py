"""The store's failures are the store's (issue 60 #5, #6): against a real ``radixkv serve``
whose SQLite files this test damages for real (truncated, overwritten, removed, made
immutable), nothing the files do kills the server; stored requests fail with a 503 naming the
file while chat and ``store: false`` go on; an answer already generated reaches its client
(marked ``store: false``); ``/health`` says which store is down; a bad path at start is one
line and exit code 2."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess

GREEDY = {"temperature": 0.0, "max_output_tokens": 4}
MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def serving(store: Path) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    server = ServerProcess("--response-store", str(store))
    try:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


def immutable(path: Path, on: bool) -> None:
    """``chattr +i``/``-i``: unwritable even for root and through descriptors already open."""
    done = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
    if on and done.returncode != 0:
        pytest.skip(f"chattr +i not permitted here: {done.stderr.decode().strip()}")


def overwrite_with_garbage(path: Path) -> None:
    """Random bytes over the whole file, in place (the same inode the server holds open)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(os.urandom(size))


def unavailable(call: object, code: str, file: Path) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()  # type: ignore[operator]
    error = caught.value
    assert error.status_code == 503, error
    assert error.code == code and str(file) in error.message, error.body
    return error


def test_a_truncated_wal_index_does_not_kill_the_server(tmp_path: Path) -> None:
    """SQLite's WAL index (``-shm``) is memory-mapped: truncated under a reader, the next
    read was a SIGBUS. The stores keep no mapped file, so truncating (or planting) one is
    harmless."""
    store = tmp_path / "responses.sqlite3"
    with serving(store) as (server, client):
        made = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
        conversation = client.conversations.create(items=[])
        for name in ("responses.sqlite3-shm", "conversations.sqlite3-shm"):
            shm = tmp_path / name
            shm.touch()
            os.truncate(shm, 0)
        assert client.responses.retrieve(made.id).id == made.id
        assert client.conversations.retrieve(conversation.id).id == conversation.id
        assert server.process.poll() is None, server.output()[-2000:]


def test_garbage_over_the_store_is_a_503_naming_it_while_chat_and_unstored_turns_go_on(
    tmp_path: Path,
) -> None:
    store = tmp_path / "responses.sqlite3"
    with serving(store) as (server, client):
        made = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
        overwrite_with_garbage(store)

        unavailable(lambda: client.responses.retrieve(made.id), "response_store_unavailable",
                    store)
        unavailable(lambda: client.responses.input_items.list(made.id),
                    "response_store_unavailable", store)
        unavailable(lambda: client.responses.delete(made.id), "response_store_unavailable",
                    store)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "degraded"
        assert health.json()["response_store"]["status"] == "unavailable"
        assert str(store) in health.json()["response_store"]["message"]

        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
        assert unstored.output_text
        # store: true (the default): the answer is generated, so the client gets it, marked
        # not stored, and the log says why
        kept = client.responses.create(model=MODEL, input="Hi", **GREEDY)
        assert kept.output_text and kept.to_dict()["store"] is False
        assert "not stored" in server.output()
        assert "Traceback" not in server.output()


def test_a_removed_store_file_is_a_503_not_a_store_that_silently_forgets(
    tmp_path: Path,
) -> None:
    """SQLite goes on writing an unlinked file, lost at the next start: say so instead."""
    store = tmp_path / "responses.sqlite3"
    with serving(store) as (server, client):
        made = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
        store.unlink()
        error = unavailable(lambda: client.responses.retrieve(made.id),
                            "response_store_unavailable", store)
        assert "removed" in error.message
        assert httpx.get(server.url + "/health").json()["status"] == "degraded"


def test_an_unwritable_journal_still_answers_and_the_store_recovers_once_writable(
    tmp_path: Path,
) -> None:
    store = tmp_path / "responses.sqlite3"
    with serving(store) as (server, client):
        first = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
        journals = [p for p in tmp_path.glob("responses.sqlite3-*") if p.name[-3:] != "shm"]
        assert journals, list(tmp_path.iterdir())
        try:
            for journal in journals:
                immutable(journal, True)
            answered = client.responses.create(model=MODEL, input="Hi", **GREEDY)
            assert answered.output_text and answered.to_dict()["store"] is False
            assert "not stored" in server.output()
            events = list(client.responses.create(model=MODEL, input="Hi", stream=True,
                                                  **GREEDY))
            last = events[-1]
            assert last.type in ("response.completed", "response.incomplete"), last
            assert last.response.to_dict()["store"] is False
            health = httpx.get(server.url + "/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert client.responses.retrieve(first.id).id == first.id  # reads go on
        finally:
            for journal in journals:
                immutable(journal, False)
        again = client.responses.create(model=MODEL, input="Hi", **GREEDY)
        assert again.to_dict()["store"] is True
        assert client.responses.retrieve(again.id).id == again.id
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_full_disk_still_answers_and_the_store_recovers_when_space_returns(
    tmp_path: Path,
) -> None:
    """A real full disk: a 1 MiB tmpfs (needs root), filled up beside the store."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with serving(disk / "responses.sqlite3") as (server, client):
            first = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
            filler = disk / "filler"
            fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
            with contextlib.suppress(OSError):  # ENOSPC: the disk is full
                while True:
                    os.write(fd, b"\0" * 65536)
            os.close(fd)
            answered = client.responses.create(model=MODEL, input="Hi " * 300, **GREEDY)
            assert answered.output and answered.to_dict()["store"] is False
            assert "full" in server.output()
            assert httpx.get(server.url + "/health").json()["status"] == "degraded"
            assert client.responses.retrieve(first.id).id == first.id  # reads go on

            filler.unlink()
            again = client.responses.create(model=MODEL, input="Hi " * 300, **GREEDY)
            assert again.to_dict()["store"] is True
            assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_garbage_over_the_conversation_store_is_a_503_naming_it(tmp_path: Path) -> None:
    conversations = tmp_path / "conversations.sqlite3"
    with serving(tmp_path / "responses.sqlite3") as (server, client):
        made = client.conversations.create(items=[])
        overwrite_with_garbage(conversations)
        unavailable(lambda: client.conversations.retrieve(made.id),
                    "conversation_store_unavailable", conversations)
        unavailable(lambda: client.conversations.create(items=[]),
                    "conversation_store_unavailable", conversations)
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "degraded"
        assert health["conversation_store"]["status"] == "unavailable"
        assert client.responses.create(model=MODEL, input="Hi", **GREEDY).output_text


@pytest.mark.parametrize("kind", ["a directory", "below a regular file", "not a database"])
def test_a_bad_store_path_at_start_is_one_line_and_exit_code_2(
    tmp_path: Path, kind: str
) -> None:
    if kind == "a directory":
        path = tmp_path
    elif kind == "below a regular file":
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "responses.sqlite3"
    else:
        path = tmp_path / "responses.sqlite3"
        path.write_bytes(b"these are not SQLite's bytes" * 100)
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--dtype", "float32", "--port", "0",
         "--response-store", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"radixkv serve: --response-store {path}: "), done.stderr[-2000:]


def test_a_store_an_older_server_left_in_wal_mode_opens_unmapped_with_its_responses(
    tmp_path: Path,
) -> None:
    """Files written by earlier versions (WAL mode, the first schema) are taken over: their
    rows kept, their journal a rollback journal from then on, no ``-shm`` left to map."""
    import sqlite3

    import msgspec

    from server.responses.store import ResponseStore, StoredResponse

    path = tmp_path / "responses.sqlite3"
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
                "created_at INTEGER NOT NULL, size INTEGER NOT NULL, record BLOB NOT NULL)")
    kept = StoredResponse(id="resp_1", tenant="", created_at=1, history=[], token_ids=[1, 2],
                          body={"id": "resp_1"})
    record = msgspec.json.encode(kept)
    old.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                ("resp_1", "", 1, len(record), record))
    old.close()

    store = ResponseStore(path, max_responses=10, max_bytes=1 << 20)
    try:
        assert store.get("resp_1", "") == kept
        assert store._db.execute("PRAGMA journal_mode").fetchone() == ("truncate",)
        assert not Path(f"{path}-shm").exists() and not Path(f"{path}-wal").exists()
    finally:
        store.close()
