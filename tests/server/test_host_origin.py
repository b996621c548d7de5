"""A server bound to loopback answers only requests that name it: a ``Host`` other than
localhost, 127.0.0.1 or [::1] (any port) is a 421 unless ``--allowed-hosts`` lists it (DNS
rebinding: a page on attacker.example whose name now resolves to 127.0.0.1), a browser request
from another origin is a 403, and a POST whose body is not ``application/json`` is a 415 (the
"simple" cross-site POST a browser sends without asking first). All as OpenAI's error JSON, on
a real server; the inspector page, fetched as a browser does, still works."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_process import ServerProcess

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


@pytest.fixture(scope="module")
def listed_url() -> Iterator[str]:
    proc = ServerProcess("--num-pages", "64", "--allowed-hosts", "api.internal", "Other.Example")
    yield proc.url
    proc.stop()


def test_a_host_not_naming_loopback_is_refused_by_a_loopback_server(server_url: str) -> None:
    port = server_url.rsplit(":", 1)[1]
    for path in ("/inspect/state", "/inspect", "/v1/models", "/metrics"):
        refused = error(httpx.get(server_url + path, headers={"Host": "attacker.example"}), 421)
        assert refused["code"] == "host_not_allowed" and "attacker.example" in refused["message"]
        assert "--allowed-hosts" in refused["message"]
    post = httpx.post(server_url + "/v1/chat/completions", json=CHAT_BODY,
                      headers={"Host": f"attacker.example:{port}"}, timeout=60)
    assert error(post, 421)["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST",
                 "127.0.0.1"):
        assert httpx.get(server_url + "/inspect/state",
                         headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_lets_the_listed_names_in_and_no_others(listed_url: str) -> None:
    port = listed_url.rsplit(":", 1)[1]
    for host in (f"api.internal:{port}", "other.example", f"127.0.0.1:{port}"):
        assert httpx.get(listed_url + "/v1/models", headers={"Host": host}).status_code == 200
    error(httpx.get(listed_url + "/v1/models", headers={"Host": "attacker.example"}), 421)


def test_a_post_whose_body_is_not_json_is_refused_with_415(server_url: str) -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "multipart/form-data"},
                    {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        reply = httpx.post(server_url + "/v1/chat/completions", content=raw, headers=headers,
                           timeout=60)
        refused = error(reply, 415)
        assert refused["code"] == "unsupported_media_type"
        assert "application/json" in refused["message"]
    ok = httpx.post(server_url + "/v1/chat/completions", content=raw, timeout=60,
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_a_cross_origin_browser_request_is_refused_with_403(server_url: str) -> None:
    for origin in ("http://attacker.example", "null", "http://localhost:1"):
        for reply in (
            httpx.post(server_url + "/v1/chat/completions", json=CHAT_BODY,
                       headers={"Origin": origin}, timeout=60),
            httpx.get(server_url + "/inspect/state", headers={"Origin": origin}),
        ):
            refused = error(reply, 403)
            assert refused["code"] == "cross_origin" and refused["type"] == "permission_error"
    same = httpx.post(server_url + "/v1/chat/completions", json=CHAT_BODY,
                      headers={"Origin": server_url}, timeout=60)
    assert same.status_code == 200, same.text


def test_the_inspector_page_fetched_as_a_browser_does_still_works(server_url: str) -> None:
    """What Chromium sends for the page and its same-origin poll (``fetch`` of a GET sends no
    ``Origin``; with one, it is the page's own)."""
    browser = {"Host": server_url.removeprefix("http://"), "Sec-Fetch-Site": "same-origin",
               "Referer": server_url + "/inspect", "Accept": "*/*"}
    for path in ("/inspect", "/inspect/inspect.js", "/inspect/inspect.css"):
        assert httpx.get(server_url + path, headers=browser).status_code == 200
    for extra in ({}, {"Origin": server_url}):
        reply = httpx.get(server_url + "/inspect/state?budget=50", headers={**browser, **extra})
        assert reply.status_code == 200 and "replicas" in reply.json()
