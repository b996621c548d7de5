"""The inspector's JSON (``GET /inspect/state``) made from the engines' snapshots.

The snapshots (``engine.api.InspectSnapshot``, one per engine or replica) hold token ids and
namespaces as the loop saw them; here they become what a viewer may see: each node's and
request's label is the decoded start of its text, shown only for the default namespace and
the namespaces whose ``cache_salt`` the viewer sent (a salt is a tenant's key to its cache,
so it is never printed: a namespace is named by a digest of it keyed by this process's random
key, so a guessable salt cannot be confirmed offline against its name). Bidi controls in a
label are shown as ``\\u202e``-style text: drawn, they reorder what a viewer reads
("invoice \\u202egpj.exe" as "invoice exe.jpg"). The replicas' request rings
merge into one list, newest first, each request with the replica that served it (where the
router sent it). Plain builtins out, for ``msgspec.json``.

The tree's nodes (up to 20,000) become ``NodeRow``s, structs the garbage collector does not
track, and their label sources stay the snapshot's own until a slice of them is decoded:
20,000 dicts and token lists alive at once set off a full collection of the server's whole
heap (~0.2 s holding the interpreter lock, so the event loop too).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

LABEL_CHARS = 48
ROUTES_SHOWN = 25
TOP_PREFIXES = 10
# Keys the namespaces' digests: new with each server process, so names hold while it runs.
_NAMESPACE_KEY = secrets.token_bytes(32)
# Unicode's bidirectional controls (embeddings, overrides, isolates, marks).
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def namespace_id(name: str | None) -> str:
    """How a namespace is shown: ``default``, or a keyed digest of its salt (never the salt,
    nor a digest anyone could recompute from a guess)."""
    if name is None:
        return "default"
    digest = hmac.new(_NAMESPACE_KEY, name.encode("utf-8"), hashlib.sha256).hexdigest()
    return "tenant-" + digest[:10]


class NodeRow(msgspec.Struct, gc=False):
    """One node as the page gets it (a struct the garbage collector does not track)."""

    ns: int
    parent: int
    offset: int
    tokens: int
    pages: int
    label: str | None
    recency: float
    in_flight: bool
    pinned: bool
    hidden_children: int
    hidden_tokens: int


def label_sources(snapshots: Mapping[str, Any], salts: Collection[str]) -> list[Any]:
    """Every label to decode, in the order ``build_state`` reads them back: visible nodes
    (their ``NodeView``: its ``head`` is made when decoded, ``label_runs``), then visible
    requests' heads and tails newest first, replica by replica."""
    sources: list[Any] = []
    for snapshot in snapshots.values():
        names = [ns.name for ns in snapshot.tree.namespaces]
        sources.extend(
            node for node in snapshot.tree.nodes if _visible(names[node.namespace], salts)
        )
        for r in reversed(snapshot.requests):
            if _visible(r.namespace, salts):
                sources.extend((r.head, r.tail))
    return sources


def label_runs(sources: list[Any]) -> list[list[int]]:
    """The token ids of ``label_sources``' items (a slice of them at a time)."""
    return [s if isinstance(s, list) else s.head for s in sources]


def build_state(
    snapshots: Mapping[str, Any],
    salts: Collection[str],
    labels: list[str],
    traffic: list[Any],
) -> dict[str, Any]:
    """The page's state: one entry per replica, the merged request routes, the totals and
    the traffic buckets. ``labels`` are ``label_sources``' runs decoded, in order."""
    texts = iter(labels)
    replicas = []
    routes = []
    for name, snapshot in snapshots.items():
        view = _replica(name, snapshot, salts, texts)
        routes.extend({**row, "replica": name} for row in view["requests"])
        replicas.append(view)
    routes.sort(key=lambda row: row["at"], reverse=True)
    totals = _totals([s.stats for s in snapshots.values()])
    return {
        "replicas": replicas,
        "routes": routes[:ROUTES_SHOWN],
        "totals": totals,
        "top_prefixes": _top_prefixes(replicas),
        "traffic": msgspec.to_builtins(traffic),
        "viewer": {"namespaces": sorted(namespace_id(s) for s in salts)},
    }


def _visible(namespace: str | None, salts: Collection[str]) -> bool:
    return namespace is None or namespace in salts


def _label(text: str) -> str:
    """One line, at most ``LABEL_CHARS`` characters (text only: the page never parses it),
    bidi controls written out (``\\u202e``) rather than obeyed."""
    flat = _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", " ".join(text.split()))
    return flat if len(flat) <= LABEL_CHARS else flat[: LABEL_CHARS - 1] + "\u2026"


def _replica(name: str, snapshot: Any, salts: Collection[str], texts: Any) -> dict[str, Any]:
    tree = snapshot.tree
    names = [ns.name for ns in tree.namespaces]
    namespaces = [
        {
            "id": namespace_id(ns.name),
            "visible": _visible(ns.name, salts),
            "hidden_children": ns.hidden_children,
            "hidden_tokens": ns.hidden_tokens,
        }
        for ns in tree.namespaces
    ]
    nodes = [
        NodeRow(
            node.namespace,
            node.parent,
            node.offset,
            node.tokens,
            node.pages,
            _label(next(texts)) if _visible(names[node.namespace], salts) else None,
            round(node.recency, 4),
            node.in_flight,
            node.pinned,
            node.hidden_children,
            node.hidden_tokens,
        )
        for node in tree.nodes
    ]
    requests = []
    for r in reversed(snapshot.requests):  # newest first
        visible = _visible(r.namespace, salts)
        requests.append(
            {
                "at": r.at,
                "namespace": namespace_id(r.namespace),
                "label": _label(next(texts)) if visible else None,
                "computed_from": _label(next(texts)) if visible else None,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "missed_tokens": r.missed_tokens,
                "boundary_tokens": r.boundary_tokens,
                "reason": r.reason,
            }
        )
    stats = snapshot.stats
    return {
        "name": name,
        "taken_at": snapshot.taken_at,
        "loop_ms": round(snapshot.loop_s * 1000, 3),
        "running": stats.requests_running,
        "waiting": stats.requests_waiting,
        "pages": msgspec.to_builtins(stats.pages),
        "tiers": msgspec.to_builtins(stats.tiers),
        "counters": _counters(stats),
        "tree": {
            "total_nodes": tree.total_nodes,
            "shown": len(tree.nodes),
            "budget": tree.budget,
            "page_size": tree.page_size,
            "namespaces": namespaces,
            "nodes": nodes,
        },
        "requests": requests,
    }


def _counters(stats: Any) -> dict[str, Any]:
    c = stats.counters
    return {
        "requests": c.requests,
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "pool_tokens": c.cached_tokens_pool,
        "host_tokens": c.cached_tokens_host,
        "disk_tokens": c.cached_tokens_disk,
        "remote_tokens": c.cached_tokens_remote,
        "computed_tokens": c.prompt_tokens - c.cached_tokens,
        "generated_tokens": c.generated_tokens,
        "evicted_pages": stats.pages.evicted,
        "restored_pages": stats.tiers.loaded_host + stats.tiers.loaded_disk
        + stats.tiers.loaded_remote,
        "hit_rate": c.hit_rate,
    }


def summed(stats: list[Any]) -> Any:
    """One EngineStats for several (the replicas' added up: ``EngineStats.total``)."""
    return stats[0] if len(stats) == 1 else type(stats[0]).total(stats)


def _totals(stats: list[Any]) -> dict[str, Any]:
    """The replicas' counters added up, the hit rate from the sums."""
    return _counters(summed(stats)) if stats else {"hit_rate": 0.0}


def _top_prefixes(replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The top-level branches holding the most tokens (shown nodes beneath them counted),
    across replicas."""
    found = []
    for replica in replicas:
        tree = replica["tree"]
        nodes = tree["nodes"]
        held = [node.tokens + node.hidden_tokens for node in nodes]
        for i in range(len(nodes) - 1, -1, -1):  # children come after their parents
            parent = nodes[i].parent
            if parent >= 0:
                held[parent] += held[i]
        for i, node in enumerate(nodes):
            if node.parent == -1:
                found.append(
                    {
                        "replica": replica["name"],
                        "namespace": tree["namespaces"][node.ns]["id"],
                        "label": node.label,
                        "tokens": held[i],
                        "recency": node.recency,
                    }
                )
    found.sort(key=lambda row: row["tokens"], reverse=True)
    return found[:TOP_PREFIXES]
