"""The disk tier: one file per page under a directory, crash-safe, content-addressed.

A file is ``header | tokens | data | checksum``: the header holds a magic, the key and both
lengths; the checksum is xxh3_64 over everything before it. A file is written under a
temporary name, fsynced, renamed into place, and its directory fsynced, so a crash leaves
either the old state or the whole new file; on read, a short, foreign or damaged file is a
miss (and is deleted), never wrong KV. Files live in ``<directory>/<store_key>/<xx>/``, where
the engine's ``store_key`` names the model, dtype and page layout: an engine never sees
another model's pages, and a restarted engine finds its own (``scan`` at open).

Writes (and deletions) run on one background thread, so eviction never waits for a disk.
A record stays readable from memory until its file is in place. The index (key -> size, least
recently used first) is owned by the caller's thread; the lock guards what the writer shares.
A write that fails (a full disk) leaves no file behind, is counted in ``write_errors`` and
logged, and its key leaves the index at the caller's next call: the store never claims a page
it does not hold.

Files hold every tenant's token ids next to their KV (and ``store.json`` names the model):
every directory the store creates is 0700 and every file it writes (pages, their temporary
files, the lock, the manifest) 0600, set explicitly so that no umask widens or narrows them,
and a store opened on files of an older, laxer version makes them private again. One engine at
a time owns a store (a lock file; a second engine on the same directory is refused rather than
counting its own budget and deleting the other's half-written files).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import struct
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import xxhash

from radix.tiers.changes import StoreWatcher
from radix.tiers.record import PageRecord

MAGIC = b"RKVPAGE1"
_HEADER = struct.Struct("<8sQQI")  # magic, key, data bytes, token bytes
_CHECKSUM = struct.Struct("<Q")
SUFFIX = ".kv"
LOCK_FILE = ".lock"
MANIFEST = "store.json"
FILE_MODE = 0o600
DIR_MODE = 0o700
log = logging.getLogger("radixkv.kv_disk")


def file_size(record: PageRecord) -> int:
    return _HEADER.size + len(record.tokens) + len(record.data) + _CHECKSUM.size


def encode_record(record: PageRecord) -> bytes:
    body = (
        _HEADER.pack(MAGIC, record.key, len(record.data), len(record.tokens))
        + record.tokens
        + record.data
    )
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_record(raw: bytes, key: int) -> PageRecord | None:
    """The record in ``raw`` if it is whole, undamaged and holds ``key``; else None."""
    if len(raw) < _HEADER.size + _CHECKSUM.size:
        return None
    magic, found, data_len, tokens_len = _HEADER.unpack_from(raw)
    if magic != MAGIC or found != key:
        return None
    end = _HEADER.size + tokens_len + data_len
    if len(raw) != end + _CHECKSUM.size:
        return None
    (checksum,) = _CHECKSUM.unpack_from(raw, end)
    view = memoryview(raw)
    if xxhash.xxh3_64_intdigest(view[:end]) != checksum:
        return None
    tokens = raw[_HEADER.size : _HEADER.size + tokens_len]
    return PageRecord(key, tokens, raw[_HEADER.size + tokens_len : end])


class DiskStore:
    """Page records as files within ``budget_bytes``, least recently used deleted first."""

    def __init__(
        self, directory: str | os.PathLike[str], budget_bytes: int, store_key: str
    ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be an int >= 0, got {budget_bytes!r}")
        if not store_key or not all(c.isalnum() or c in "-_." for c in store_key):
            raise ValueError(f"store_key: must be a non-empty file name, got {store_key!r}")
        self._root = Path(directory) / store_key
        self._lock_fd = _open_locked(Path(directory), self._root)
        self._budget = budget_bytes
        self._index: OrderedDict[int, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._lock = threading.Lock()
        self._pending: dict[int, PageRecord] = {}  # written soon; readable from memory now
        self._ops: queue.Queue[tuple[str, int, PageRecord | None] | None] = queue.Queue()
        self.corrupt = 0  # files found damaged, truncated or foreign (and deleted)
        self.evicted = 0  # records deleted to stay within the budget
        self.write_errors = 0  # files the writer could not write (disk full, ...)
        self._failed: list[tuple[int, int]] = []  # (key, size) whose write failed: unindex
        self._watcher: StoreWatcher | None = None
        self._scan()
        free = shutil.disk_usage(self._root).free + self._used
        if budget_bytes > free:
            warnings.warn(
                f"kv_disk_bytes: {budget_bytes} bytes asked for, but only {free} are free on "
                f"{self._root}: writes past that will fail (counted as write errors)",
                stacklevel=3,
            )
        self._writer = threading.Thread(
            target=self._write_loop, name="radixkv-kv-disk", daemon=True
        )
        self._writer.start()

    # ------------------------------------------------------------------ state

    @property
    def directory(self) -> Path:
        return self._root

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        self._unindex_failed()
        return self._used

    def __len__(self) -> int:
        self._unindex_failed()
        return len(self._index)

    def __contains__(self, key: int) -> bool:
        self._unindex_failed()
        return key in self._index

    def keys(self) -> list[int]:
        self._unindex_failed()
        return list(self._index)

    def path(self, key: int) -> Path:
        return self._root / f"{key >> 56:02x}" / f"{key:016x}{SUFFIX}"

    def watch(self, watcher: StoreWatcher | None) -> None:
        """Call ``watcher(added, removed)`` with every change of the keys indexed from now on
        (on the caller's thread: a failed write leaves the index at the caller's next call)."""
        self._watcher = watcher

    def _changed(self, added: Sequence[int], removed: Sequence[int]) -> None:
        if self._watcher is not None and (added or removed):
            self._watcher(added, removed)

    # ------------------------------------------------------------------ records

    def touch(self, key: int) -> None:
        if key in self._index:
            self._index.move_to_end(key)

    def put(self, record: PageRecord) -> bool:
        """Keep ``record`` (written in the background); False when it cannot fit at all."""
        key = record.key
        self._unindex_failed()
        if key in self._index:
            self._index.move_to_end(key)
            return True
        size = file_size(record)
        if size > self._budget:
            return False
        while self._used + size > self._budget:
            self._drop(next(iter(self._index)))
            self.evicted += 1
        self._index[key] = size
        self._used += size
        with self._lock:
            self._pending[key] = record
        self._ops.put(("write", key, record))
        self._changed((key,), ())
        return True

    def get(self, key: int, tokens: bytes) -> PageRecord | None:
        """The record of ``key`` holding ``tokens``; None when absent or unreadable (a bad
        file is deleted and counted in ``corrupt``)."""
        self._unindex_failed()
        if key not in self._index:
            return None
        with self._lock:
            record = self._pending.get(key)
        if record is None:
            try:
                raw = self.path(key).read_bytes()
            except OSError:
                raw = b""
            record = decode_record(raw, key)
            if record is None:
                self.corrupt += 1
                self._drop(key)
                return None
        if record.tokens != tokens:
            return None  # a 64-bit collision: another prefix's page
        self._index.move_to_end(key)
        return record

    def remove(self, key: int) -> None:
        if key in self._index:
            self._drop(key)

    def flush(self) -> None:
        """Wait until every queued write and deletion is on disk."""
        self._ops.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        if self._writer.is_alive():
            self._ops.put(None)
            self._writer.join()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the store's lock
            self._lock_fd = None

    def check(self) -> None:
        self._unindex_failed()
        used = sum(self._index.values())
        assert used == self._used, f"disk: {self._used} bytes counted, {used} indexed"
        assert self._used <= self._budget, f"disk: {self._used} bytes over {self._budget}"
        with self._lock:
            stray = set(self._pending) - set(self._index)
        assert not stray, f"disk: {len(stray)} pending writes of keys no longer indexed"

    # ------------------------------------------------------------------ internals

    def _unindex_failed(self) -> None:
        """Forget the keys whose files the writer could not write (caller's thread)."""
        if not self._failed:
            return
        with self._lock:
            failed, self._failed = self._failed, []
        gone = []
        for key, size in failed:
            if self._index.get(key) == size:
                del self._index[key]
                self._used -= size
                gone.append(key)
        self._changed((), gone)

    def _drop(self, key: int) -> None:
        self._used -= self._index.pop(key)
        with self._lock:
            self._pending.pop(key, None)
        self._ops.put(("delete", key, None))
        self._changed((), (key,))

    def _scan(self) -> None:
        """Index the files a previous engine left (oldest first); clear half-written ones."""
        found: list[tuple[float, int, int]] = []
        for sub in self._root.iterdir():
            if sub.name.startswith(".") and sub.name.endswith(".tmp"):
                _unlink(sub)  # a manifest a crash interrupted
                continue
            if not sub.is_dir():
                _make_private(sub, FILE_MODE)
                continue
            _make_private(sub, DIR_MODE)
            for entry in os.scandir(sub):
                name = entry.name
                if name.startswith(".") and name.endswith(".tmp"):
                    _unlink(Path(entry.path))  # a write a crash interrupted
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    key = int(name[: -len(SUFFIX)], 16)
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                if stat.st_mode & 0o777 != FILE_MODE:
                    _make_private(Path(entry.path), FILE_MODE)
                found.append((stat.st_mtime, key, stat.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        while self._used > self._budget:
            key, size = self._index.popitem(last=False)
            self._used -= size
            _unlink(self.path(key))

    def _write_loop(self) -> None:
        while True:
            op = self._ops.get()
            try:
                if op is None:
                    return
                kind, key, record = op
                if kind == "delete":
                    _unlink(self.path(key))
                    continue
                with self._lock:
                    current = self._pending.get(key) is record
                if not current:
                    continue  # evicted (or replaced) before it was written
                try:
                    self._write_file(key, record)
                    failed = False
                except OSError as exc:
                    failed = True
                    self.write_errors += 1
                    if self.write_errors == 1 or self.write_errors % 100 == 0:
                        log.warning(
                            "kv disk tier: %d page writes failed so far (%s); those pages "
                            "are recomputed when needed", self.write_errors, exc,
                        )
                with self._lock:
                    if self._pending.get(key) is record:
                        del self._pending[key]
                        if failed:
                            self._failed.append((key, file_size(record)))
            finally:
                self._ops.task_done()

    def _write_file(self, key: int, record: PageRecord | None) -> None:
        assert record is not None
        path = self.path(key)
        _private_dir(path.parent)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        _write_private(tmp, path, encode_record(record))

    def write_manifest(self, text: str) -> None:
        """``store.json``: what the store holds, for a person (nobody reads it back: the
        directory's name is the key). Written once, privately: it names what a tenant's
        engine cached."""
        path = self._root / MANIFEST
        if path.exists():
            _make_private(path, FILE_MODE)  # a laxer older version's manifest
            return
        tmp = self._root / f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp"
        _write_private(tmp, path, text.encode())


def ensure_directory(directory: Path) -> None:
    """``directory`` and its parents exist, those created here 0700 (ones that exist keep
    their modes: the operator's); a ValueError naming ``kv_disk_dir`` where it cannot be
    (read-only, a path under a file, no access)."""
    missing = []
    parent = directory
    while not parent.is_dir() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        for path in reversed(missing):
            _private_dir(path)
    except OSError as exc:
        raise ValueError(
            f"kv_disk_dir: cannot use {str(directory)!r}: {exc.strerror or exc}"
        ) from exc


def _private_dir(path: Path) -> None:
    """``path`` exists as a directory and is 0700, whatever the umask."""
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise
    if path.stat().st_mode & 0o777 != DIR_MODE:
        path.chmod(DIR_MODE)


def _make_private(path: Path, mode: int) -> None:
    try:
        path.chmod(mode)
    except FileNotFoundError:
        pass


def _write_private(tmp: Path, path: Path, data: bytes) -> None:
    """``data`` in ``path``, 0600 whatever the umask, crash-safe: written to ``tmp``,
    fsynced, renamed into place, the directory fsynced; a failed write leaves nothing."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # the umask narrowed the mode above, never widens it
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        _unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _open_locked(directory: Path, root: Path) -> int:
    """Create ``root`` (0700) and take its lock file (0600); a ValueError naming
    ``kv_disk_dir`` when the directory cannot be used or another engine holds the store."""
    ensure_directory(root)
    try:
        _private_dir(root)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
        os.fchmod(fd, FILE_MODE)
    except OSError as exc:
        raise ValueError(
            f"kv_disk_dir: cannot use {str(directory)!r}: {exc.strerror or exc}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise ValueError(
            f"kv_disk_dir: {str(directory)!r} is in use by another engine (one engine per "
            "directory: its budget and half-written files are its own)"
        ) from exc
    return fd


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
