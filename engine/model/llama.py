"""Our decoder over a ragged batch with paged KV, for every family we run (Llama, Mistral,
Qwen2/3, Gemma 2/3, Phi-3): one forward, where a family is its ``ModelConfig`` fields (q/k
norms, sandwich norms, the MLP's activation, scaled embeddings, soft caps, per-layer windows
and RoPE bases; ``engine.model.families``).

Weights come from a transformers state dict; q/k/v and gate/up projections are fused into
one matrix product each (Phi-3's checkpoints come fused). Every layer writes its new K/V into
the pool through the attention backend, then attends over the request's pages (the backend
knows each layer's score scale, soft cap and window).

Where the platform has products of its own (the CPU's batch-invariant kernel,
``use_packed_products``), activations stay float32 between layers whatever the weights' dtype,
each row's numbers depend on that row alone, and a decoder layer is four packed products
(RMSNorm fused into the q/k/v and gate/up products, SiLU or GELU * up into the down product,
the residual adds into the o and down products) around RoPE and attention; the families'
other row transforms (q/k norms, the norms after attention and MLP, the logits' soft cap) are
the platform's ``RowOps``. Elsewhere (CUDA, or where the kernel cannot be built) torch's
products and row transforms run in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.model_config import GELU_TANH, ModelConfig
from engine.model.platform import (
    GELU_MUL,
    NONE,
    RMSNORM,
    SILU_MUL,
    PackedProduct,
    Packer,
    RowOps,
)
from engine.model.rope import Rope, RotaryEmbedding, rotary_permutation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference does (the fused
        # rms_norm computes x * rsqrt(mean(x^2) + eps), bit for bit the reference's formula).
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)

    def weight_f32(self) -> torch.Tensor:
        return self.weight.detach().float().contiguous()


class Dense(nn.Module):
    """A linear layer. Where the platform packs products (the CPU) it runs the platform's product
    over a packed copy of the weight (``packed``, set by ``LlamaModel.use_packed_products``),
    float32 in and out; without it, torch's product over the weight kept transposed,
    ``[in, out]``: the layout the CPU BLAS prefers for a decode step's products
    (``workloads.model_bench`` compares them). Weights load from transformers' ``[out, in]``
    tensors with ``load``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: PackedProduct | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def pack(self, packer: Packer) -> None:
        self.packed = packer(self.weight_t.detach().t(), self.bias)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy a transformers-layout weight ``[out, in]`` (and bias ``[out]``)."""
        if tuple(weight.shape) != tuple(self.weight_t.shape[::-1]):
            raise ValueError(
                f"weights: shape {tuple(weight.shape)}, expected {tuple(self.weight_t.shape[::-1])}"
            )
        self.weight_t.copy_(weight.t())
        if self.bias is not None:
            if bias is None:
                raise ValueError("weights: checkpoint lacks a bias this layer has")
            self.bias.copy_(bias)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Dense(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Dense(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_qk(qkv)
        return self.o_proj(backend.run_qkv(self.layer, qkv, rope, pool))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each q and k head RMS-normalised by its own weight (Qwen3, Gemma 3)."""
        assert self.q_norm is not None and self.k_norm is not None
        t, d = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, -1, d))
        return torch.cat([q, k.reshape(t, -1), qkv[:, self.q_size + self.kv_size :]], dim=1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.mlp_act == GELU_TANH
        self.gate_up_proj = Dense(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Dense(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act.mul_(up))


class DecoderLayer(nn.Module):
    """Attention then MLP, each with a norm before it and, in sandwich-norm families (Gemma),
    one after it too, before the residual add."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.window = config.is_window_layer(layer)
        self.attn_norm = RMSNorm(dim, eps)
        self.self_attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = MLP(config)
        self.attn_out_norm = RMSNorm(dim, eps) if config.sandwich_norm else None
        self.mlp_out_norm = RMSNorm(dim, eps) if config.sandwich_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        a = self.self_attn(self.attn_norm(x), rope, backend, pool)
        x = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


@dataclass(frozen=True, slots=True)
class NativeLayer:
    """A decoder layer as packed products run it: four products and one attention call,
    float32 in and out, with the family's row transforms between them. Plain attributes, so
    a step reads no ``nn.Module`` lookups."""

    layer: int
    window: bool  # a sliding-window layer (its RoPE table may differ)
    qkv: PackedProduct
    o: PackedProduct
    gate_up: PackedProduct
    down: PackedProduct
    act: int  # the down product's prologue: SILU_MUL or GELU_MUL
    eps: float
    attn_norm: torch.Tensor  # float32 copies of the RMSNorm weights
    mlp_norm: torch.Tensor
    rows: RowOps | None
    qk_norm: torch.Tensor | None  # [(Hq + Hkv) * D]: each head's q or k norm weight
    qk_heads: int
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None

    @classmethod
    def of(cls, layer: DecoderLayer, rows: RowOps | None) -> NativeLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = attn.qkv_proj.packed, attn.o_proj.packed
        gate_up, down = mlp.gate_up_proj.packed, mlp.down_proj.packed
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        qk_norm = None
        if attn.q_norm is not None and attn.k_norm is not None:
            qk_norm = torch.cat(
                [attn.q_norm.weight_f32().repeat(attn.num_heads),
                 attn.k_norm.weight_f32().repeat(attn.num_kv_heads)]
            ).contiguous()
        attn_out = layer.attn_out_norm.weight_f32() if layer.attn_out_norm is not None else None
        mlp_out = layer.mlp_out_norm.weight_f32() if layer.mlp_out_norm is not None else None
        if rows is None and (qk_norm is not None or attn_out is not None):
            raise ValueError("model: its norms need the platform's row transforms (none here)")
        return cls(
            attn.layer, layer.window, qkv, o, gate_up, down,
            GELU_MUL if mlp.gelu else SILU_MUL, layer.attn_norm.eps,
            layer.attn_norm.weight_f32(), layer.mlp_norm.weight_f32(), rows, qk_norm,
            attn.num_heads + attn.num_kv_heads, attn_out, mlp_out,
        )

    def forward(
        self, x: torch.Tensor, rope: Rope, backend: AttentionBackend, pool: KVPool, threads: int
    ) -> torch.Tensor:
        qkv = self.qkv(x, RMSNORM, self.attn_norm, self.eps, threads=threads)
        if self.qk_norm is not None:
            assert self.rows is not None
            qk = qkv[:, : self.qk_norm.numel()]
            self.rows.rms_norm(qk, self.qk_norm, self.eps, self.qk_heads, in_place=True,
                               threads=threads)
        attended = backend.run_qkv(self.layer, qkv, rope, pool)
        if self.attn_out_norm is None:
            x = self.o(attended, NONE, residual=x, threads=threads)
        else:
            assert self.rows is not None
            a = self.o(attended, NONE, threads=threads)
            x = self.rows.rms_norm(a, self.attn_out_norm, self.eps, residual=x, threads=threads)
        gate_up = self.gate_up(x, RMSNORM, self.mlp_norm, self.eps, threads=threads)
        if self.mlp_out_norm is None:
            return self.down(gate_up, self.act, residual=x, threads=threads)
        assert self.rows is not None
        m = self.down(gate_up, self.act, threads=threads)
        return self.rows.rms_norm(m, self.mlp_out_norm, self.eps, residual=x, threads=threads)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head: logits only where they are sampled."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        # Window layers with a RoPE base of their own (Gemma 3) read their own table.
        self.local_rope = RotaryEmbedding(config, local=True) if config.local_rope_theta else None
        # Tied embeddings get a transposed copy here (Dense's layout), not a shared tensor.
        self.lm_head = Dense(config.hidden_size, config.vocab_size)
        self.products: str | None = None  # the packed products' path, else None (torch)
        self._final_norm_weight = torch.empty(0)
        self._native_layers: list[NativeLayer] = []
        self._rows: RowOps | None = None

    @torch.no_grad()
    def use_packed_products(self, packer: Packer, rows: RowOps | None = None) -> None:
        """Pack every linear layer's weight by ``packer`` (the platform's products; once: a
        model shared by engines is packed by the first), with ``rows`` for the family's row
        transforms. Called after the weights are loaded."""
        if self.products is not None:
            return
        if rows is None and self.config.final_softcap:
            raise ValueError("model: its logits' soft cap needs the platform's row transforms")
        for module in self.modules():
            if isinstance(module, Dense):
                module.pack(packer)
        self._native_layers = [NativeLayer.of(layer, rows) for layer in self.layers]
        self._final_norm_weight = self.norm.weight_f32()
        self._rows = rows
        assert self.lm_head.packed is not None
        self.products = self.lm_head.packed.path()

    def forward(
        self,
        forward_batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        threads: int = 1,
    ) -> torch.Tensor:
        """fp32 logits ``[len(logits_indices), vocab]``; K/V of all tokens lands in ``pool``.
        ``threads``: how many threads packed products split their columns over."""
        backend.plan(forward_batch)
        return self.forward_planned(forward_batch, pool, backend, threads)

    def _embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = self.embed_tokens(input_ids).to(dtype)
        scale = self.config.embed_scale
        if scale != 1.0:  # in the weights' dtype first, as transformers rounds it
            x = x * torch.tensor(scale, dtype=self.embed_tokens.weight.dtype).to(dtype)
        return x

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Rope, Rope]:
        """The global layers' cos/sin and the window layers' (the same where they share one)."""
        rope = self.rope.lookup(positions, dtype)
        local = self.local_rope.lookup(positions, dtype) if self.local_rope is not None else rope
        return rope, local

    def forward_planned(
        self,
        forward_batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        threads: int = 1,
    ) -> torch.Tensor:
        """``forward`` after ``backend.plan(forward_batch)``: only tensor work, which is what
        a decode graph captures (its plan runs on the host before each replay)."""
        cap = self.config.final_softcap
        if self.products is not None:
            x = self._embed(forward_batch.input_ids, torch.float32)
            rope, local = self._ropes(forward_batch.positions, x.dtype)
            for native_layer in self._native_layers:
                x = native_layer.forward(
                    x, local if native_layer.window else rope, backend, pool, threads
                )
            assert self.lm_head.packed is not None
            logits = self.lm_head.packed(
                x.index_select(0, forward_batch.logits_indices),
                RMSNORM,
                self._final_norm_weight,
                self.norm.eps,
                threads=threads,
            )
            if cap:
                assert self._rows is not None
                self._rows.softcap_(logits, cap, threads=threads)
            return logits
        x = self._embed(forward_batch.input_ids, self.embed_tokens.weight.dtype)
        rope, local = self._ropes(forward_batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, local if layer.window else rope, backend, pool)
        x = self.norm(x.index_select(0, forward_batch.logits_indices))
        logits = self.lm_head(x).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' checkpoints of our families: q/k/v and
        gate/up separate or fused (Phi-3), norms stored as w - 1 (Gemma) made w, the q/k rows
        of a partial-rotary model put in the layout our RoPE turns (``rotary_permutation``)."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"weights: checkpoint lacks {name!r}")
            return state[name]

        def norm(module: RMSNorm | None, name: str, perm: torch.Tensor | None = None) -> None:
            assert module is not None
            w = take(name).float()
            w = w + 1.0 if cfg.norm_plus_one else w
            module.weight.copy_(w if perm is None else w[perm])

        def fused(prefix: str, names: tuple[str, ...], fused_name: str, kind: str) -> torch.Tensor:
            if prefix + fused_name + "." + kind in state:
                return state[prefix + fused_name + "." + kind]
            return torch.cat([take(prefix + n + "." + kind) for n in names], dim=0)

        perm = None
        if cfg.rotary_dims != cfg.head_dim:
            perm = rotary_permutation(cfg.head_dim, cfg.rotary_dims)
        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        norm(self.norm, "model.norm.weight")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head.load(take(head))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            att = layer.self_attn
            qkv_names = ("q_proj", "k_proj", "v_proj")
            qkv_w = fused(p + "self_attn.", qkv_names, "qkv_proj", "weight")
            qkv_b = fused(p + "self_attn.", qkv_names, "qkv_proj", "bias") if cfg.attention_bias else None
            if perm is not None:
                qkv_w, qkv_b = _permute_qk(qkv_w, perm, cfg), _permute_qk(qkv_b, perm, cfg)
            att.qkv_proj.load(qkv_w, qkv_b)
            o_bias = take(p + "self_attn.o_proj.bias") if att.o_proj.bias is not None else None
            att.o_proj.load(take(p + "self_attn.o_proj.weight"), o_bias)
            if att.q_norm is not None:
                norm(att.q_norm, p + "self_attn.q_norm.weight", perm)
                norm(att.k_norm, p + "self_attn.k_norm.weight", perm)
            layer.mlp.gate_up_proj.load(
                fused(p + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj", "weight")
            )
            layer.mlp.down_proj.load(take(p + "mlp.down_proj.weight"))
            norm(layer.attn_norm, p + "input_layernorm.weight")
            if cfg.sandwich_norm:
                norm(layer.attn_out_norm, p + "post_attention_layernorm.weight")
                norm(layer.mlp_norm, p + "pre_feedforward_layernorm.weight")
                norm(layer.mlp_out_norm, p + "post_feedforward_layernorm.weight")
            else:
                norm(layer.mlp_norm, p + "post_attention_layernorm.weight")


def _permute_qk(
    t: torch.Tensor | None, perm: torch.Tensor, cfg: ModelConfig
) -> torch.Tensor | None:
    """The q and k heads' rows (of a fused q/k/v weight or bias) each permuted by ``perm``."""
    if t is None:
        return None
    d = cfg.head_dim
    qk_rows = (cfg.num_heads + cfg.num_kv_heads) * d
    qk = t[:qk_rows].unflatten(0, (-1, d))[:, perm].flatten(0, 1)
    return torch.cat([qk, t[qk_rows:]], dim=0)
