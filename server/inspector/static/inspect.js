// radixkv cache inspector: polls /inspect/state and draws it. Every piece of text from the
// server goes in through textContent or an SVG text node, never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const ROW = 20;            // icicle row height, px
const MAX_DEPTH = 40;      // icicle rows drawn at most (deeper nodes sit on the last row)
const REFRESH_MS = 2000;
const REASONS = {
  hit: "all cached", page_boundary: "page boundary", evicted: "evicted",
  other_namespace: "other namespace", never_seen: "never seen",
};

let paused = false;
let timer = null;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function int(n) { return Number(n).toLocaleString("en-US"); }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function ms(s) { return s === null || s === undefined ? "–" : (1000 * s).toFixed(1) + " ms"; }
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB"); }

function b64url(text) {
  let bin = "";
  for (const b of new TextEncoder().encode(text)) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function setField(root, name, text) {
  for (const node of root.querySelectorAll(`[data-field="${name}"]`)) node.textContent = text;
}

// ------------------------------------------------------------------------------- viewer

function viewer() {
  const key = document.getElementById("api-key").value.trim();
  const salts = document.getElementById("salts").value.split(",").map(s => s.trim()).filter(Boolean);
  const budget = document.getElementById("budget").value || "400";
  const headers = {};
  if (key) headers["Authorization"] = "Bearer " + key;
  if (salts.length) headers["X-Radixkv-Cache-Salts"] = salts.map(b64url).join(",");
  return { headers, budget };
}

function remember() {
  for (const id of ["api-key", "salts", "budget"]) {
    sessionStorage.setItem("radixkv-" + id, document.getElementById(id).value);
  }
}

function restore() {
  for (const id of ["api-key", "salts", "budget"]) {
    const v = sessionStorage.getItem("radixkv-" + id);
    if (v !== null) document.getElementById(id).value = v;
  }
}

// ------------------------------------------------------------------------------- polling

async function refresh() {
  timer = null;
  const status = document.getElementById("status");
  const { headers, budget } = viewer();
  try {
    const response = await fetch(`/inspect/state?budget=${encodeURIComponent(budget)}`,
                                 { headers, cache: "no-store" });
    const body = await response.json();
    if (!response.ok) {
      status.className = "error";
      status.textContent = `${response.status}: ${(body.error && body.error.message) || "error"}`;
    } else {
      render(body);
      window.radixkvState = body;  // what the page drew (tests and curious operators read it)
      const loop = body.replicas.map(r => `${r.name} ${r.loop_ms.toFixed(2)} ms`).join(", ");
      status.className = "";
      status.textContent = `updated ${new Date().toLocaleTimeString("en-GB")} · snapshot on ` +
        `the loop: ${loop}` + (body.viewer.namespaces.length
          ? ` · showing text of ${body.viewer.namespaces.join(", ")}` : "");
      document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
    }
  } catch (err) {
    status.className = "error";
    status.textContent = "cannot reach the server: " + err.message;
  }
  if (!paused) timer = setTimeout(refresh, REFRESH_MS);
}

// ------------------------------------------------------------------------------- drawing

function render(state) {
  document.body.classList.toggle("single", state.replicas.length < 2);
  const t = state.totals;
  const summary = document.getElementById("summary");
  setField(summary, "totals.hit_rate", pct(t.hit_rate || 0));
  for (const name of ["requests", "prompt_tokens", "pool_tokens", "host_tokens", "disk_tokens",
                      "remote_tokens", "computed_tokens", "evicted_pages"]) {
    setField(summary, "totals." + name, int(t[name] || 0));
  }
  drawPlots(state.traffic);
  drawReplicas(state.replicas);
  drawRoutes(state.routes);
}

function drawReplicas(replicas) {
  const box = document.getElementById("replicas");
  box.style.gridTemplateColumns = `repeat(${Math.max(1, replicas.length)}, minmax(0, 1fr))`;
  box.replaceChildren(...replicas.map(replicaColumn));
}

function replicaColumn(r) {
  const col = el("section", { class: "replica", "data-replica": r.name });
  col.append(el("h3", {}, r.name));
  const p = r.pages;
  col.append(el("h3", {}, "KV pool pages"));
  col.append(bar([[p.cached - p.pinned, "seg-cached"], [p.pinned, "seg-pinned"],
                  [p.private, "seg-private"]], p.total));
  col.append(numbers([["free", p.free, "pages.free"], ["cached", p.cached, "pages.cached"],
                      ["private", p.private, "pages.private"], ["pinned", p.pinned, "pages.pinned"],
                      ["of", p.total, "pages.total"]]));
  const tiers = r.tiers;
  if (tiers.host_budget_bytes || tiers.disk_budget_bytes) {
    col.append(el("h3", {}, "tiers below the pool"));
    if (tiers.host_budget_bytes) {
      col.append(bar([[tiers.host_bytes, "seg-host"]], tiers.host_budget_bytes));
      col.append(numbers([["host pages", tiers.host_pages, "tiers.host_pages"],
                          ["bytes", bytes(tiers.host_bytes), null],
                          ["of", bytes(tiers.host_budget_bytes), null]]));
    }
    if (tiers.disk_budget_bytes) {
      col.append(bar([[tiers.disk_bytes, "seg-disk"]], tiers.disk_budget_bytes));
      col.append(numbers([["disk pages", tiers.disk_pages, "tiers.disk_pages"],
                          ["bytes", bytes(tiers.disk_bytes), null],
                          ["of", bytes(tiers.disk_budget_bytes), null]]));
    }
  }
  const c = r.counters;
  col.append(numbers([["hit rate", pct(c.hit_rate), "counters.hit_rate"],
                      ["running", r.running, "running"], ["waiting", r.waiting, "waiting"],
                      ["evicted", c.evicted_pages, "counters.evicted_pages"],
                      ["restored", c.restored_pages, "counters.restored_pages"]]));
  const tree = r.tree;
  col.append(el("h3", {}, `radix tree: ${int(tree.shown)} of ${int(tree.total_nodes)} nodes ` +
                           `(page size ${tree.page_size})`));
  const holder = el("div", { class: "icicle-box" });
  holder.append(icicle(tree));
  col.append(holder);
  return col;
}

function bar(parts, total) {
  const b = el("div", { class: "bar" });
  for (const [value, cls] of parts) {
    const seg = el("div", { class: cls });
    seg.style.width = total > 0 ? `${(100 * Math.max(0, value)) / total}%` : "0";
    b.append(seg);
  }
  return b;
}

function numbers(items) {
  const row = el("div", { class: "numbers" });
  for (const [label, value, field] of items) {
    const span = el("span", {}, label + " ");
    const b = el("b", field ? { "data-field": field } : {},
                 typeof value === "number" ? int(value) : String(value));
    span.append(b);
    row.append(span);
  }
  return row;
}

function colour(recency) {
  const hue = 215 - 185 * recency;
  return `hsl(${hue.toFixed(0)}, 62%, ${(42 + 12 * recency).toFixed(0)}%)`;
}

// The icicle: one band per namespace, each node below its parent, its width its tokens (its
// own run, the runs summarised beneath it, and its shown descendants).
function icicle(tree) {
  const nodes = tree.nodes;
  const size = nodes.map(n => n.tokens + n.hidden_tokens);
  const kids = nodes.map(() => []);
  const depth = new Array(nodes.length).fill(0);
  const tops = tree.namespaces.map(() => []);
  nodes.forEach((n, i) => {
    if (n.parent < 0) tops[n.ns].push(i);
    else { kids[n.parent].push(i); depth[i] = Math.min(depth[n.parent] + 1, MAX_DEPTH); }
  });
  for (let i = nodes.length - 1; i >= 0; i--) {
    if (nodes[i].parent >= 0) size[nodes[i].parent] += size[i];
  }
  const nsSize = tree.namespaces.map((ns, k) =>
    tops[k].reduce((a, i) => a + size[i], 0) + ns.hidden_tokens);
  const used = tree.namespaces.map((_, k) => k).filter(k => nsSize[k] > 0);
  const width = 1000;
  const rows = Math.max(1, ...depth.map(d => d + 1)) + 1;
  const root = svg("svg", { class: "icicle", viewBox: `0 0 ${width} ${rows * ROW}`,
                            width: "100%", height: rows * ROW, preserveAspectRatio: "none",
                            "data-nodes": nodes.length });
  const total = used.reduce((a, k) => a + nsSize[k], 0);
  if (!total) {
    root.append(svg("text", { x: 6, y: 14, class: "hidden-text" }, "the tree is empty"));
    return root;
  }
  let x = 0;
  for (const k of used) {
    const ns = tree.namespaces[k];
    const w = (width * nsSize[k]) / total;
    const band = svg("g", { class: "namespace", "data-namespace": ns.id });
    band.append(svg("rect", { class: "ns", x, y: 0, width: Math.max(w - 1, 0.5), height: ROW - 2 }));
    band.append(clippedText(x + 3, 14, w - 6,
      `${ns.id}${ns.visible ? "" : " (text hidden)"} · ${int(nsSize[k])} tokens`, false));
    band.append(svg("title", {}, `${ns.id}: ${int(nsSize[k])} tokens shown`));
    let cx = x;
    for (const i of tops[k]) { cx = place(i, cx, w / nsSize[k], band); }
    if (ns.hidden_children) more(band, cx, ROW, (w * ns.hidden_tokens) / nsSize[k], ns.hidden_children);
    root.append(band);
    x += w;
  }
  return root;

  function place(i, x0, scale, band) {
    const n = nodes[i];
    const w = size[i] * scale;
    const y = (depth[i] + 1) * ROW;
    const cls = "node" + (n.pinned ? " pinned" : "") + (n.in_flight ? " in-flight" : "");
    const rect = svg("rect", { class: cls, x: x0, y, width: Math.max(w - 0.5, 0.3),
                               height: ROW - 2, fill: colour(n.recency), "data-index": i });
    rect.append(svg("title", {},
      `${n.label === null ? "(another tenant's text)" : n.label}\n${int(n.tokens)} tokens in ` +
      `${int(n.pages)} pages, from token ${int(n.offset)}` +
      (n.pinned ? "\npinned" : "") + (n.in_flight ? "\nin flight" : "") +
      (n.hidden_children ? `\n+${n.hidden_children} children not shown` : "")));
    band.append(rect);
    if (w > 28) {
      band.append(clippedText(x0 + 3, y + 14, w - 6,
                              n.label === null ? "(hidden)" : n.label, n.label === null, i));
    }
    let cx = x0 + n.tokens * scale;
    for (const k of kids[i]) cx = place(k, cx, scale, band);
    if (n.hidden_children) more(band, cx, y + ROW, n.hidden_tokens * scale, n.hidden_children);
    return x0 + w;
  }

  function more(band, x0, y, w, count) {
    if (depth.length && y / ROW > MAX_DEPTH + 1) return;
    const r = svg("rect", { class: "more", x: x0, y, width: Math.max(w - 0.5, 0.3), height: ROW - 2 });
    r.append(svg("title", {}, `${count} more nodes, not shown (node budget)`));
    band.append(r);
    if (w > 28) band.append(clippedText(x0 + 3, y + 14, w - 6, `+${count}`, true));
  }
}

function clippedText(x, y, w, text, muted, index) {
  const chars = Math.max(0, Math.floor(w / 6.6));
  const shown = text.length > chars ? text.slice(0, Math.max(0, chars - 1)) + "…" : text;
  const attrs = { x, y, class: muted ? "hidden-text label" : "label" };
  if (index !== undefined) attrs["data-index"] = index;
  const t = svg("text", attrs, shown);
  t.dataset.full = text;
  return t;
}

// ------------------------------------------------------------------------------- plots

function drawPlots(buckets) {
  const plots = [
    ["hit rate", [["hit_rate", "#4e79a7", "of prompt tokens"]], v => pct(v), 1],
    ["prompt tokens by source", [["pool_tokens", "#4e79a7", "pool"], ["host_tokens", "#f28e2b", "host"],
      ["disk_tokens", "#76b7b2", "disk"], ["remote_tokens", "#b07aa1", "shared store"],
      ["computed_tokens", "#bab0ac", "computed"]], int],
    ["time to first token", [["ttft_p50", "#4e79a7", "p50"], ["ttft_p95", "#e15759", "p95"]], ms],
    ["inter-token latency", [["itl_p50", "#4e79a7", "p50"], ["itl_p95", "#e15759", "p95"]], ms],
    ["throughput", [["tokens_per_s", "#59a14f", "generated tokens/s"]], v => v.toFixed(1)],
    ["evictions and restores", [["evicted_pages", "#e15759", "evicted pages"],
      ["restored_pages", "#f28e2b", "restored pages"]], int],
  ];
  const box = document.getElementById("plots");
  box.replaceChildren(...plots.map(([title, series, fmt, fixedMax]) =>
    plot(title, series, fmt, fixedMax, buckets)));
}

function plot(title, series, fmt, fixedMax, buckets) {
  const card = el("div", { class: "plot" });
  const values = series.map(([key]) => buckets.map(b => b[key]));
  const flat = values.flat().filter(v => v !== null && v !== undefined);
  const max = fixedMax || Math.max(1e-9, ...flat);
  const last = series.map(([key, , name], k) => {
    const v = [...values[k]].reverse().find(x => x !== null && x !== undefined);
    return `${name} ${v === undefined ? "–" : fmt(v)}`;
  }).join(" · ");
  card.append(el("h3", {}, title));
  const w = 240, h = 60;
  const s = svg("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none" });
  s.append(svg("line", { x1: 0, y1: h - 0.5, x2: w, y2: h - 0.5, stroke: "#ccc" }));
  series.forEach(([, stroke], k) => {
    const pts = [];
    values[k].forEach((v, i) => {
      if (v === null || v === undefined) return;
      const x = buckets.length > 1 ? (i * w) / (buckets.length - 1) : w;
      pts.push(`${x.toFixed(1)},${(h - 2 - (v / max) * (h - 6)).toFixed(1)}`);
    });
    if (pts.length) {
      s.append(svg("polyline", { points: pts.join(" "), fill: "none", stroke, "stroke-width": 1.6 }));
      const [cx, cy] = pts[pts.length - 1].split(",");
      s.append(svg("circle", { cx, cy, r: 2.2, fill: stroke }));
    }
  });
  card.append(s);
  card.append(el("div", { class: "legend" }, `${last} · max ${fmt(max)}`));
  return card;
}

// ------------------------------------------------------------------------------- requests

function drawRoutes(routes) {
  const body = document.querySelector("#routes tbody");
  body.replaceChildren(...routes.map(r => {
    const tr = el("tr", { "data-replica": r.replica });
    tr.append(el("td", {}, clock(r.at)));
    tr.append(el("td", { class: "replica-col" }, r.replica));
    tr.append(el("td", {}, r.namespace));
    tr.append(r.label === null ? el("td", { class: "prompt muted" }, "(another tenant's text)")
                               : el("td", { class: "prompt", title: r.label }, r.label));
    tr.append(r.computed_from === null ? el("td", { class: "prompt muted" }, "–")
                                       : el("td", { class: "prompt", title: r.computed_from },
                                            r.computed_from));
    tr.append(el("td", {}, `${int(r.cached_tokens)} / ${int(r.prompt_tokens)}`));
    const why = r.missed_tokens
      ? `${REASONS[r.reason] || r.reason}: ${int(r.missed_tokens)} tokens` +
        (r.boundary_tokens ? ` (+${int(r.boundary_tokens)} page boundary)` : "")
      : `${REASONS[r.reason] || r.reason}` +
        (r.boundary_tokens ? `: ${int(r.boundary_tokens)} tokens` : "");
    tr.append(el("td", { class: "reason-" + r.reason }, why));
    return tr;
  }));
}

// ------------------------------------------------------------------------------- start

document.addEventListener("DOMContentLoaded", () => {
  restore();
  document.getElementById("viewer").addEventListener("change", () => {
    remember();
    if (timer) clearTimeout(timer);
    refresh();
  });
  document.getElementById("viewer").addEventListener("submit", e => e.preventDefault());
  document.getElementById("pause").addEventListener("click", e => {
    paused = !paused;
    e.target.textContent = paused ? "resume" : "pause";
    if (!paused && !timer) refresh();
  });
  refresh();
});
