"""GET /inspect and /inspect/state on a real server: what the cache holds, why requests
missed, tenants' text only to who holds their salt, OpenAI's error JSON for bad input, and
the page itself self-contained. Reach and auth through the same app in process."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from cluster.cli import main as cli_main
from engine import Engine
from server import ServerConfig, create_app
from server.inspector.cli import summary

STATIC = Path(__file__).resolve().parents[3] / "server" / "inspector" / "static"
SYSTEM = "You are the inspector test's assistant; answer in one short sentence please. " * 3


def salts_header(*salts: str) -> dict[str, str]:
    return {"X-Radixkv-Cache-Salts": ",".join(
        base64.urlsafe_b64encode(s.encode()).decode().rstrip("=") for s in salts)}


def chat(url: str, question: str, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4, "temperature": 0,
    }
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def traffic(server_url: str) -> str:
    """Two chats sharing the system prompt, one under a tenant's salt."""
    chat(server_url, "What is a radix tree?")
    chat(server_url, "Why cache prefixes?")
    chat(server_url, "What is a radix tree?", salt="inspect-tenant-secret")
    return server_url


def state(url: str, **headers: str) -> dict[str, Any]:
    reply = httpx.get(url + "/inspect/state", headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_state_shows_the_shared_prefix_and_why_each_request_missed(traffic: str) -> None:
    body = state(traffic)
    [engine] = body["replicas"]
    labels = [n["label"] for n in engine["tree"]["nodes"]]
    assert any(label and "You are the inspector" in label for label in labels)
    assert engine["tree"]["shown"] == len(engine["tree"]["nodes"]) <= body["budget"]
    pages = engine["pages"]
    assert pages["free"] + pages["cached"] + pages["private"] == pages["total"]
    mine = [r for r in body["routes"] if r["label"] and "You are the inspector" in r["label"]]
    assert mine, body["routes"]
    # the second chat found the system prompt cached: only the page boundary or its own
    # question was computed
    assert any(r["cached_tokens"] > 0 for r in mine)
    assert {r["reason"] for r in body["routes"]} <= {
        "hit", "evicted", "other_namespace", "never_seen", "page_boundary"}
    assert 0.0 <= body["totals"]["hit_rate"] <= 1.0


def test_a_tenants_text_shows_only_to_who_sends_its_salt(traffic: str) -> None:
    tenant = [r for r in state(traffic)["routes"] if r["namespace"].startswith("tenant-")]
    assert tenant and all(r["label"] is None for r in tenant)
    assert all("inspect-tenant-secret" not in r["namespace"] for r in tenant)
    # the tenant's request found the default namespace's copy of its prompt: not shared
    assert any(r["reason"] == "other_namespace" for r in tenant)
    shown = state(traffic, **salts_header("inspect-tenant-secret"))
    tenant_rows = [r for r in shown["routes"] if r["namespace"].startswith("tenant-")]
    assert any(r["label"] and "You are the inspector" in r["label"] for r in tenant_rows)
    assert shown["viewer"]["namespaces"] == [tenant_rows[0]["namespace"]]


def test_bidi_controls_in_a_label_are_shown_escaped(server_url: str) -> None:
    """``invoice \\u202egpj.exe`` would read "invoice exe.jpg" drawn as it is: the label
    carries the control as visible ``\\u202e`` text instead."""
    reply = httpx.post(server_url + "/v1/completions", timeout=120, json={
        "prompt": "invoice \u202egpj.exe \u2066attached\u2069 for the bidi test", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    labels = [r["label"] for r in state(server_url)["routes"] if r["label"]]
    shown = next(label for label in labels if "invoice" in label)
    assert "invoice \\u202egpj.exe" in shown
    assert not any(ch in label for label in labels for ch in "\u202a\u202b\u202c\u202d\u202e"
                   "\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def test_a_namespace_is_named_by_a_keyed_digest_not_one_anyone_can_recompute(
    server_url: str,
) -> None:
    """A low-entropy salt cannot be confirmed offline against its name: the digest is keyed
    by the server's own random key (stable while it runs)."""
    import hashlib

    salt = "1234"
    chat(server_url, "Which tenant am I?", salt=salt)
    mine = state(server_url, **salts_header(salt))["viewer"]["namespaces"]
    assert len(mine) == 1 and mine[0].startswith("tenant-")
    assert mine == state(server_url, **salts_header(salt))["viewer"]["namespaces"]
    for digest in (hashlib.sha256, hashlib.sha1, hashlib.md5, hashlib.blake2b):
        assert digest(salt.encode()).hexdigest()[:10] not in mine[0]


@pytest.mark.parametrize(
    ("query", "headers", "param"),
    [
        ("?budget=lots", {}, "budget"),
        ("?budget=-1", {}, "budget"),
        ("", {"X-Radixkv-Cache-Salts": "%%%"}, "x-radixkv-cache-salts"),
    ],
)
def test_bad_input_is_a_400_in_openais_shape(
    server_url: str, query: str, headers: dict[str, str], param: str
) -> None:
    reply = httpx.get(server_url + "/inspect/state" + query, headers=headers, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_the_budget_bounds_the_nodes_returned(traffic: str) -> None:
    body = httpx.get(traffic + "/inspect/state?budget=1", timeout=30).json()
    [engine] = body["replicas"]
    assert len(engine["tree"]["nodes"]) == 1 and engine["tree"]["budget"] == 1


def test_the_page_is_self_contained_and_forbids_anything_else(server_url: str) -> None:
    page = httpx.get(server_url + "/inspect", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    for name in ("inspect.js", "inspect.css"):
        asset = httpx.get(f"{server_url}/inspect/{name}", timeout=30)
        assert asset.status_code == 200 and asset.content == (STATIC / name).read_bytes()
    assert httpx.get(server_url + "/inspect/nope.js", timeout=30).status_code == 404
    for path in STATIC.iterdir():
        urls = re.findall(r"https?://[^\s\"'`)]+", path.read_text())
        assert urls in ([], ["http://www.w3.org/2000/svg"]), (path.name, urls)
    assert "innerHTML" not in (STATIC / "inspect.js").read_text()


def test_the_terminal_summary_names_the_top_prefix_and_the_hit_rate(traffic: str) -> None:
    text = summary(state(traffic))
    assert re.search(r"hit rate \d+\.\d% over \d+ requests", text)
    assert "You are the inspector" in text
    assert "engine: pages" in text


def test_radixkv_inspect_prints_the_summary_and_fails_on_a_dead_url(
    traffic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["inspect", traffic + "/inspect", "--requests", "3"]) == 0
    out = capsys.readouterr().out
    assert "top prefixes" in out and "You are the inspector" in out
    assert cli_main(["inspect", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


# ------------------------------------------------------------------------- reach and auth


@pytest.fixture(scope="module")
def engine(loaded_fp32: Any) -> Any:
    engine = Engine(model=loaded_fp32, num_pages=64)
    yield engine
    engine.close()


def test_clients_beyond_loopback_are_refused_unless_the_inspector_is_public(engine: Any) -> None:
    # TestClient's client address is "testclient": not loopback
    with TestClient(create_app(engine)) as client:
        for path in ("/inspect", "/inspect/state"):
            reply = client.get(path)
            assert reply.status_code == 403
            assert reply.json()["error"]["code"] == "inspect_not_public"
    with TestClient(create_app(engine, ServerConfig(inspect_public=True))) as client:
        assert client.get("/inspect").status_code == 200
        assert client.get("/inspect/state").status_code == 200


def test_the_state_needs_the_api_key_as_the_api_does(engine: Any) -> None:
    config = ServerConfig(inspect_public=True, api_key="sesame")
    with TestClient(create_app(engine, config)) as client:
        assert client.get("/inspect").status_code == 200  # the page holds no data
        refused = client.get("/inspect/state")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        ok = client.get("/inspect/state", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.json()["replicas"][0]["name"] == "engine"
