"""Headless Chromium over its DevTools protocol: open a page, read its DOM, take a screenshot,
and hear every console error, uncaught exception and failed load.

No browser automation library: Debian's ``chromium`` started with
``--remote-debugging-port=0`` writes the port it took into ``DevToolsActivePort`` in its
profile directory; one websocket to the page's target carries the commands
(``Page.navigate``, ``Runtime.evaluate``, ``Page.captureScreenshot``) and the events
(``Runtime.consoleAPICalled``, ``Runtime.exceptionThrown``, ``Log.entryAdded``).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--mute-audio",
)


def find_chromium() -> str | None:
    """The Chromium binary on PATH (None: not installed; ``apt-get install chromium``)."""
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


class HeadlessChromium:
    """One headless Chromium with one page; ``errors`` collects what its console reported."""

    def __init__(self, binary: str | None = None, start_timeout_s: float = 60.0) -> None:
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no Chromium on PATH (Debian: apt-get install chromium)")
        self._profile = Path(tempfile.mkdtemp(prefix="radixkv-chromium-"))
        self._process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-port=0",
             "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        try:
            port = self._wait_port(start_timeout_s)
            self._socket = self._page_socket(port, start_timeout_s)
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _wait_port(self, timeout_s: float) -> int:
        marker = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"chromium exited at start (status {self._process.returncode})")
            if marker.exists():
                lines = marker.read_text().split()
                if lines:
                    return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port in {timeout_s} s")

    def _page_socket(self, port: int, timeout_s: float) -> ClientConnection:
        deadline = time.monotonic() + timeout_s
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = json.load(r)
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            if time.monotonic() > deadline:
                raise TimeoutError("chromium has no page target")
            time.sleep(0.1)

    # ------------------------------------------------------------------------------ protocol

    def call(self, method: str, timeout_s: float = 60.0, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events met meanwhile are kept)."""
        ident = next(self._ids)
        self._socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._socket.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._on_event(message)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
            self.errors.append("console: " + " ".join(texts))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            self.errors.append("exception: " + str(exception.get("description", details.get("text"))))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
        elif method is not None:
            self._events.append(message)

    def pump(self, seconds: float) -> None:
        """Read events for ``seconds`` (console errors arrive as events)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                self._on_event(json.loads(self._socket.recv(timeout=left)))
            except TimeoutError:
                return

    # ------------------------------------------------------------------------------ page

    def open(self, url: str, width: int = 1400, height: int = 1000, timeout_s: float = 60.0) -> None:
        """Navigate to ``url`` in a ``width`` x ``height`` viewport and wait for its load."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self._events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load in {timeout_s} s")
            self.pump(0.1)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still false after {timeout_s} s")
            self.pump(0.2)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (the whole document when ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                              "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            try:
                socket.send(json.dumps({"id": next(self._ids), "method": "Browser.close"}))
            except Exception:  # closing anyway
                pass
            socket.close()
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
