"""The child process of ``test_native_fuzz``: calls the native kernels with the bad arguments
the test describes, one JSON case a line on stdin, one JSON outcome a line on stdout.

A case is ``{"entry", "mutation", "seed", "threads"}``: the worker builds a valid call of
``entry`` (small random shapes from ``seed``), breaks it as ``mutation`` says, sets torch's
threads and the call's to ``threads``, and reports ``{"outcome": "ok" | "error", "type",
"message"}``. A crash ends the process; the test sees the pipe close and says which case did it.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.model.cpu import exact_attention
from engine.model.cpu.products import load_products
from engine.model.platform import GELU_MUL, NONE, RMSNORM, SILU_MUL

CPU = torch.device("cpu")

# Mutations per entry point; "valid" and "empty" calls must succeed, every other must be refused.
PLAN_MUTATIONS = [
    "index_dtype", "tables_1d", "page_past_pool", "page_negative", "table_lens_past_width",
    "table_lens_negative", "table_lens_count", "q_seq_past_requests", "q_seq_negative",
    "q_pos_negative", "q_pos_past_pages", "order_duplicate", "order_past_tokens",
    "item_ptr_past_tokens", "item_ptr_decreasing", "item_ptr_empty", "item_ptr_noncontiguous",
    "group_zero", "group_negative", "threads_zero", "threads_negative", "threads_huge",
    "k_dtype", "kv_shapes_differ", "k_noncontiguous", "head_dim_not_32", "pool_empty", "k_meta",
    "softcap_negative", "softcap_nan", "window_negative",
]
MUTATIONS: dict[str, list[str]] = {
    "exact_attention": ["valid", "empty", "q_dtype", "q_dims", "q_noncontiguous", "q_heads",
                        "q_meta", "q_seq_count", *PLAN_MUTATIONS],
    "rope_write_attend": ["valid", "empty", "slot_past_pool", "slot_negative", "slots_int32",
                          "slots_count", "qkv_width", "qkv_dtype", "qkv_column_stride",
                          "qkv_dims", "cos_count", "sin_dtype", "head_dim_past_512",
                          "plan_tokens", *PLAN_MUTATIONS],
    "dense": ["valid", "empty", "x_dtype", "x_dims", "x_column_stride", "features",
              "packed_dims", "packed_float16", "packed_int32", "packed_noncontiguous",
              "packed_last_dim", "n_negative", "n_past_packed", "prologue_unknown",
              "silu_odd_width", "norm_missing", "norm_size", "bias_size", "bias_dtype",
              "residual_shape", "residual_column_stride", "threads_zero", "threads_huge",
              "x_meta"],
    "pack": ["valid", "empty", "w_1d", "w_3d", "w_float16", "w_int32", "w_float64", "w_meta"],
}


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose last dim has stride 2 (not contiguous)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def _attention_call(entry: str, mutation: str, rng: random.Random, threads: int) -> Callable[[], Any]:
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 3])
    dim = 576 if mutation == "head_dim_past_512" else rng.choice([32, 64])
    if mutation == "head_dim_not_32":
        dim = 48
    page_size = rng.choice([1, 4, 16])
    requests = rng.randint(1, 3)
    kv = [rng.randint(1, 40) for _ in range(requests)]
    qo = [rng.randint(1, n) for n in kv]
    need = [-(-n // page_size) for n in kv]
    pages = sum(need) + 1
    free = rng.sample(range(pages), pages)
    tables = [[free.pop() for _ in range(n)] for n in need]
    plan = exact_attention.plan_native(qo, kv, tables, CPU)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    k = torch.randn(pages, page_size, hkv, dim).to(dtype)
    v = torch.randn(pages, page_size, hkv, dim).to(dtype)
    T, hq = sum(qo), hkv * group
    p = {f: getattr(plan, f) for f in ("tables", "table_lens", "q_seq", "q_pos", "order",
                                        "item_ptr")}
    slots = torch.tensor(
        [tables[s][pos // page_size] * page_size + pos % page_size
         for s in range(requests) for pos in range(kv[s] - qo[s], kv[s])], dtype=torch.int64)
    q = torch.randn(T, hq, dim)
    qkv = torch.randn(T, (hq + 2 * hkv) * dim)
    cos, sin = torch.randn(T, dim // 2), torch.randn(T, dim // 2)
    scale = dim**-0.5
    if mutation == "empty":
        T = 0
        q, qkv, slots = q[:0], qkv[:0], slots[:0]
        cos, sin = cos[:0], sin[:0]
        p = {"tables": torch.zeros(0, 0, dtype=torch.int32), "table_lens": _i32([]),
             "q_seq": _i32([]), "q_pos": _i32([]), "order": _i32([]), "item_ptr": _i32([0])}
    m = mutation
    if m == "index_dtype":
        p["tables"] = p["tables"].long()
    elif m == "tables_1d":
        p["tables"] = p["tables"].flatten()
    elif m in ("page_past_pool", "page_negative"):
        p["tables"] = p["tables"].clone()
        p["tables"][0, 0] = pages if m == "page_past_pool" else -1
    elif m in ("table_lens_past_width", "table_lens_negative"):
        p["table_lens"] = p["table_lens"].clone()
        p["table_lens"][0] = p["tables"].shape[1] + 1 if m == "table_lens_past_width" else -1
    elif m == "table_lens_count":
        p["table_lens"] = torch.cat([p["table_lens"], _i32([1])])
    elif m in ("q_seq_past_requests", "q_seq_negative"):
        p["q_seq"] = p["q_seq"].clone()
        p["q_seq"][0] = requests if m == "q_seq_past_requests" else -1
    elif m == "q_seq_count":
        p["q_seq"] = p["q_seq"][:-1]
    elif m in ("q_pos_negative", "q_pos_past_pages"):
        p["q_pos"] = p["q_pos"].clone()
        s = int(p["q_seq"][0])
        p["q_pos"][0] = -1 if m == "q_pos_negative" else int(p["table_lens"][s]) * page_size
    elif m == "order_duplicate":
        p["order"] = p["order"].clone()
        p["order"][-1] = p["order"][0] if T > 1 else T
    elif m == "order_past_tokens":
        p["order"] = p["order"].clone()
        p["order"][0] = T
    elif m == "item_ptr_past_tokens":
        p["item_ptr"] = p["item_ptr"].clone()
        p["item_ptr"][-1] = T + rng.randint(1, 64)
    elif m == "item_ptr_decreasing":
        p["item_ptr"] = _i32([0, T + 1, T])
    elif m == "item_ptr_empty":
        p["item_ptr"] = _i32([])
    elif m == "item_ptr_noncontiguous":
        p["item_ptr"] = _strided(p["item_ptr"])
    elif m in ("k_dtype", "kv_shapes_differ", "k_noncontiguous", "pool_empty", "k_meta"):
        k = {"k_dtype": lambda: k.to(torch.float16),
             "kv_shapes_differ": lambda: torch.cat([k, k[:1]]),
             "k_noncontiguous": lambda: _strided(k),
             "pool_empty": lambda: k[:0],
             "k_meta": lambda: k.to("meta")}[m]()
        if m == "pool_empty":
            v = v[:0]
    elif m == "q_dtype":
        q = q.to(rng.choice([torch.float64, torch.bfloat16]))
    elif m == "q_dims":
        q = q.unsqueeze(0)
    elif m == "q_noncontiguous":
        q = _strided(q)
    elif m == "q_heads":
        q = torch.randn(T, hq + 1, dim)
    elif m == "q_meta":
        q = q.to("meta")
    elif m in ("slot_past_pool", "slot_negative"):
        slots = slots.clone()
        slots[rng.randrange(T)] = pages * page_size if m == "slot_past_pool" else -1
    elif m == "slots_int32":
        slots = slots.int()
    elif m == "slots_count":
        slots = slots[:-1]
    elif m == "qkv_width":
        qkv = torch.randn(T, qkv.shape[1] + dim)
    elif m == "qkv_dtype":
        qkv = qkv.double()
    elif m == "qkv_column_stride":
        qkv = _strided(qkv)
    elif m == "qkv_dims":
        qkv = qkv.view(T, -1, dim)
    elif m == "cos_count":
        cos = torch.randn(T + 1, dim // 2)
    elif m == "sin_dtype":
        sin = sin.bfloat16()
    elif m == "plan_tokens":
        qkv = torch.cat([qkv, qkv[:1]])
        cos, sin = torch.cat([cos, cos[:1]]), torch.cat([sin, sin[:1]])
        slots = torch.cat([slots, slots[:1]])
    if m in ("group_zero", "group_negative"):
        group = 0 if m == "group_zero" else -rng.randint(1, 8)
    if m in ("threads_zero", "threads_negative", "threads_huge"):
        threads = {"threads_zero": 0, "threads_negative": -2, "threads_huge": 1 << 20}[m]
    # a valid call may cap its scores and slide a window (Gemma's variants)
    softcap = rng.choice([0.0, 0.0, rng.uniform(0.5, 60.0)])
    window = rng.choice([0, 0, rng.randint(1, 200)])
    if m in ("softcap_negative", "softcap_nan"):
        softcap = -1.0 if m == "softcap_negative" else float("nan")
    if m == "window_negative":
        window = -rng.randint(1, 100)
    order = (p["tables"], p["table_lens"], p["q_seq"], p["q_pos"], p["order"], p["item_ptr"])
    kernel = KERNELS["attention"]
    if entry == "exact_attention":
        return lambda: kernel.exact_attention(q, k, v, *order, group, scale, threads, softcap,
                                              window)
    return lambda: kernel.rope_write_attend(qkv, cos, sin, slots, k, v, *order, group, scale,
                                            threads, softcap, window)


def _dense_call(mutation: str, rng: random.Random, threads: int) -> Callable[[], Any]:
    kernel = KERNELS["products"]
    rows, k_in, n = rng.randint(1, 5), rng.randint(1, 70), rng.randint(1, 70)
    prologue = rng.choice([NONE, RMSNORM, SILU_MUL, GELU_MUL])
    weight = torch.randn(n, k_in).to(rng.choice([torch.float32, torch.bfloat16]))
    packed = kernel.pack(weight)
    x = torch.randn(rows, 2 * k_in if prologue in (SILU_MUL, GELU_MUL) else k_in)
    norm = torch.rand(k_in) if prologue == RMSNORM else None
    bias = torch.randn(n) if rng.random() < 0.5 else None
    residual = torch.randn(rows, n) if rng.random() < 0.5 else None
    m = mutation
    if m == "empty":
        x = x[:0]
        residual = None if residual is None else residual[:0]
    elif m == "x_dtype":
        x = x.to(rng.choice([torch.float64, torch.bfloat16, torch.int32]))
    elif m == "x_dims":
        x = x.unsqueeze(0)
    elif m == "x_column_stride":
        x = _strided(x)
    elif m == "features":
        # +-2 inputs (a bfloat16 weight packed in pairs takes an odd K as K + 1 with a zero)
        step = rng.choice([-3, -2, 2, 3]) * (2 if prologue == SILU_MUL else 1)
        x = torch.randn(rows, x.shape[1] + step if x.shape[1] + step > 0 else 200)
    elif m == "packed_dims":
        packed = packed.flatten(1)
    elif m == "packed_float16":
        packed = packed.to(torch.float16)
    elif m == "packed_int32":
        packed = packed.to(torch.int32)
    elif m == "packed_noncontiguous":
        packed = _strided(packed)
    elif m == "packed_last_dim":
        packed = packed[..., :-1].contiguous()
    elif m == "n_negative":
        n = -rng.randint(1, 100)
    elif m == "n_past_packed":
        n = packed.shape[0] * 32 + rng.randint(1, 64)
    elif m == "prologue_unknown":
        prologue = rng.choice([-1, 4, 99])
    elif m == "silu_odd_width":
        prologue = SILU_MUL
        x = torch.randn(rows, 2 * k_in + 1)
    elif m == "norm_missing":
        prologue, norm = RMSNORM, None
        x = torch.randn(rows, k_in)
    elif m == "norm_size":
        prologue, norm = RMSNORM, torch.rand(k_in + 1)
        x = torch.randn(rows, k_in)
    elif m == "bias_size":
        bias = torch.randn(n + 1)
    elif m == "bias_dtype":
        bias = torch.randn(n).double()
    elif m == "residual_shape":
        residual = torch.randn(rows + 1, n)
    elif m == "residual_column_stride":
        residual = _strided(torch.randn(rows, max(n, 2)))
        if n < 2:
            residual = torch.randn(rows + 1, n)  # a column stride means nothing for one column
    elif m == "x_meta":
        x = x.to("meta")
    if m in ("threads_zero", "threads_huge"):
        threads = 0 if m == "threads_zero" else 1 << 20
    return lambda: kernel.dense(x, packed, n, prologue, norm, 1e-6, bias, residual, threads)


def _pack_call(mutation: str, rng: random.Random) -> Callable[[], Any]:
    kernel = KERNELS["products"]
    n, k = rng.randint(1, 70), rng.randint(1, 70)
    w = torch.randn(n, k).to(rng.choice([torch.float32, torch.bfloat16]))
    w = {"valid": lambda: w, "empty": lambda: w[:0], "w_1d": lambda: w.flatten(),
         "w_3d": lambda: w.unsqueeze(0), "w_float16": lambda: w.half(),
         "w_int32": lambda: w.int(), "w_float64": lambda: w.double(),
         "w_meta": lambda: w.to("meta")}[mutation]()
    return lambda: kernel.pack(w)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    entry, mutation, threads = case["entry"], case["mutation"], int(case["threads"])
    rng = random.Random(case["seed"])
    torch.manual_seed(case["seed"])
    torch.set_num_threads(max(1, threads))
    if entry in ("exact_attention", "rope_write_attend"):
        call = _attention_call(entry, mutation, rng, threads)
    elif entry == "dense":
        call = _dense_call(mutation, rng, threads)
    else:
        call = _pack_call(mutation, rng)
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - the test judges the type
        return {"outcome": "error", "type": type(exc).__name__,
                "runtime_error": isinstance(exc, RuntimeError), "message": str(exc)[:300]}
    return {"outcome": "ok", "shape": list(out.shape)}


KERNELS: dict[str, Any] = {}


def main() -> None:
    KERNELS["attention"] = exact_attention.load_kernel()
    KERNELS["products"] = load_products()
    missing = [name for name, k in KERNELS.items() if k is None]
    print(json.dumps({"ready": not missing, "missing": missing}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_case(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
