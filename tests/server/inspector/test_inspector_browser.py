"""The inspector page in a real browser: headless Chromium (Debian's package) opens /inspect
on a real server while requests run, draws the tree, shows the numbers /inspect/state gives,
renders a prompt holding <script> as text, writes a screenshot under bench-results/, and its
console stays free of errors. Skipped where Chromium is not installed."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from workloads.inspector_bench.chromium import HeadlessChromium, find_chromium

ROOT = Path(__file__).resolve().parents[3]
DOCUMENT = (
    "Browser test manual, chapter one. The radix tree keeps every prompt's pages once; "
    "requests that share a prefix share its pages. "
) * 3
SCRIPT_PROMPT = "<script>window.inspectorPwned = 1</script> describe a harmless prompt"

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="Chromium is not installed (Debian: apt-get install -y chromium)",
)


def ask(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> None:
    reply = httpx.post(url + path, json={"max_tokens": 6, "temperature": 0, **body}, timeout=300)
    assert reply.status_code == 200, reply.text


def workload(url: str) -> list[tuple[str, dict[str, Any]]]:
    """RAG-shaped: one document, several questions, and the <script> prompt."""
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"messages": [
            {"role": "system", "content": DOCUMENT},
            {"role": "user", "content": f"Question {i}: what does chapter one say?"}]})
        for i in range(8)
    ]
    calls.insert(2, ("/v1/completions", {"prompt": SCRIPT_PROMPT}))
    return calls


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(url + "/inspect/state", timeout=60).json()
        if all(r["running"] == 0 and r["waiting"] == 0 for r in body["replicas"]):
            return body
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.2)


def test_the_page_draws_the_cache_under_traffic_with_no_console_errors(server_url: str) -> None:
    with HeadlessChromium() as browser, concurrent.futures.ThreadPoolExecutor(3) as pool:
        browser.open(server_url + "/inspect")
        browser.wait_for("Number(document.body.dataset.rendered || 0) >= 1")
        running = [pool.submit(ask, server_url, body, path) for path, body in workload(server_url)]
        seen_busy = 0
        while not all(f.done() for f in running):  # the page refreshes while requests run
            seen_busy = max(seen_busy, browser.evaluate(
                "window.radixkvState ? window.radixkvState.replicas[0].running : 0"))
            browser.pump(0.5)
        for f in running:
            f.result()
        expected = wait_idle(server_url)
        browser.evaluate("refresh()")  # the page's own poll, now, on the idle server
        shown = browser.evaluate("window.radixkvState")
        drawn = browser.evaluate("""(() => {
            const col = document.querySelector('section.replica');
            const field = n => col.querySelector(`[data-field="${n}"]`).textContent;
            return {
              nodes: document.querySelectorAll('svg.icicle rect.node').length,
              labels: [...document.querySelectorAll('svg.icicle text')].map(t => t.dataset.full),
              prompts: [...document.querySelectorAll('#routes td.prompt')].map(t => t.textContent),
              free: field('pages.free'), cached: field('pages.cached'),
              total: field('pages.total'),
              requests: document.querySelector('[data-field="totals.requests"]').textContent,
              hit_rate: document.querySelector('[data-field="totals.hit_rate"]').textContent,
              scripts: document.querySelectorAll('script').length,
              pwned: window.inspectorPwned === 1,
            };
        })()""")
        shot = browser.screenshot(ROOT / "bench-results" / "inspect" / "browser-test.png")
        browser.pump(0.5)
        errors = list(browser.errors)
    engine = expected["replicas"][0]
    # the numbers on the page are those of /inspect/state
    assert shown["totals"] == expected["totals"]
    assert drawn["nodes"] == len(engine["tree"]["nodes"]) > 0
    assert drawn["free"] == f"{engine['pages']['free']:,}"
    assert drawn["cached"] == f"{engine['pages']['cached']:,}"
    assert drawn["total"] == f"{engine['pages']['total']:,}"
    assert drawn["requests"] == f"{expected['totals']['requests']:,}"
    assert drawn["hit_rate"] == f"{100 * expected['totals']['hit_rate']:.1f}%"
    # the document's prefix is drawn, labelled with its text
    assert any(label and "Browser test manual" in label for label in drawn["labels"])
    # a prompt holding <script> is text on the page, never a script
    assert any(p.startswith("<script>window.inspectorPwned") for p in drawn["prompts"])
    assert drawn["scripts"] == 1 and not drawn["pwned"]
    assert errors == []
    assert shot.stat().st_size > 10_000
