"""Our Llama-family forward (Llama, Mistral, Qwen2) over a ragged batch with paged KV.

Weights come from a transformers state dict; q/k/v and gate/up projections are fused into
one matrix product each. Every layer writes its new K/V into the pool through the attention
backend, then attends over the request's pages.

Where the platform has products of its own (the CPU's batch-invariant kernel,
``use_packed_products``), activations stay float32 between layers whatever the weights' dtype,
each row's numbers depend on that row alone, and a decoder layer is four packed products
(RMSNorm fused into the q/k/v and gate/up products, SiLU * up into the down product, the
residual adds into the o and down products) around RoPE and attention. Elsewhere (CUDA, or
where the kernel cannot be built) torch's products run in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.model_config import ModelConfig
from engine.model.platform import NONE, RMSNORM, SILU_MUL, PackedProduct, Packer
from engine.model.rope import Rope, RotaryEmbedding


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
        # Llama's attention_bias covers o_proj too; Qwen2's bias is on q/k/v only.
        self.o_proj = Dense(
            self.q_size, config.hidden_size, bias=config.attention_bias and config.arch != "qwen2"
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        out = self._attend(self.qkv_proj(x), rope, backend, pool)
        return self.o_proj(out)

    def _attend(
        self, qkv: torch.Tensor, rope: Rope, backend: AttentionBackend, pool: KVPool
    ) -> torch.Tensor:
        """RoPE on q and k, then attention: ``[T, q_size]`` (the backend's fused kernel where
        it has one)."""
        return backend.run_qkv(self.layer, qkv, rope, pool)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Dense(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Dense(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True, slots=True)
class NativeLayer:
    """A decoder layer as packed products run it: four products and one attention call,
    float32 in and out. Plain attributes, so a step reads no ``nn.Module`` lookups."""

    layer: int
    qkv: PackedProduct
    o: PackedProduct
    gate_up: PackedProduct
    down: PackedProduct
    norm_in: torch.Tensor  # float32 copies of the RMSNorm weights
    norm_post: torch.Tensor
    eps_in: float
    eps_post: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> NativeLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = attn.qkv_proj.packed, attn.o_proj.packed
        gate_up, down = mlp.gate_up_proj.packed, mlp.down_proj.packed
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
        return cls(
            attn.layer, qkv, o, gate_up, down, norm_in.weight_f32(), norm_post.weight_f32(),
            norm_in.eps, norm_post.eps,
        )

    def forward(
        self, x: torch.Tensor, rope: Rope, backend: AttentionBackend, pool: KVPool, threads: int
    ) -> torch.Tensor:
        qkv = self.qkv(x, RMSNORM, self.norm_in, self.eps_in, threads=threads)
        x = self.o(backend.run_qkv(self.layer, qkv, rope, pool), NONE, residual=x, threads=threads)
        gate_up = self.gate_up(x, RMSNORM, self.norm_post, self.eps_post, threads=threads)
        return self.down(gate_up, SILU_MUL, residual=x, threads=threads)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head: logits only where they are sampled."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        # Tied embeddings get a transposed copy here (Dense's layout), not a shared tensor.
        self.lm_head = Dense(config.hidden_size, config.vocab_size)
        self.products: str | None = None  # the packed products' path, else None (torch)
        self._final_norm_weight = torch.empty(0)
        self._native_layers: list[NativeLayer] = []

    @torch.no_grad()
    def use_packed_products(self, packer: Packer) -> None:
        """Pack every linear layer's weight by ``packer`` (the platform's products; once: a
        model shared by engines is packed by the first). Called after the weights are loaded."""
        if self.products is not None:
            return
        for module in self.modules():
            if isinstance(module, Dense):
                module.pack(packer)
        self._native_layers = [NativeLayer.of(layer) for layer in self.layers]
        self._final_norm_weight = self.norm.weight_f32()
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

    def forward_planned(
        self,
        forward_batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        threads: int = 1,
    ) -> torch.Tensor:
        """``forward`` after ``backend.plan(forward_batch)``: only tensor work, which is what
        a decode graph captures (its plan runs on the host before each replay)."""
        x = self.embed_tokens(forward_batch.input_ids)
        if self.products is not None:
            x = x.float()
            rope = self.rope.lookup(forward_batch.positions, x.dtype)
            for native_layer in self._native_layers:
                x = native_layer.forward(x, rope, backend, pool, threads)
            assert self.lm_head.packed is not None
            return self.lm_head.packed(
                x.index_select(0, forward_batch.logits_indices),
                RMSNORM,
                self._final_norm_weight,
                self.norm.eps,
                threads=threads,
            )
        rope = self.rope.lookup(forward_batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, pool)
        x = self.norm(x.index_select(0, forward_batch.logits_indices))
        return self.lm_head(x).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' Llama/Mistral/Qwen2 checkpoints."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"weights: checkpoint lacks {name!r}")
            return state[name]

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head.load(take(head))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            att = layer.self_attn
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            att.qkv_proj.load(
                torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0), qkv_bias
            )
            o_bias = take(p + "self_attn.o_proj.bias") if att.o_proj.bias is not None else None
            att.o_proj.load(take(p + "self_attn.o_proj.weight"), o_bias)
            layer.mlp.gate_up_proj.load(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            )
            layer.mlp.down_proj.load(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
