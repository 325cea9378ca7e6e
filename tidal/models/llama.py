"""One decoder for the Llama family: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm), Mistral,
and their Mixture-of-Experts kin, Qwen3-MoE and Mixtral (a router over SwiGLU experts in
place of the MLP, in the layers the config names).

Tokens of all requests run flat ([T, H]); attention is delegated to an AttentionBackend
that reads and writes the paged KV cache described by the ForwardBatch. The residual
stream is carried separately from the normed activations so that every RMSNorm also does
the residual add, and each norm is handed to the product after it (`norm_product`), which
for one token on CUDA runs the add, the norm and the product as one kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.base import AttentionBackend
from tidal.batch import ForwardBatch
from tidal.layers.linear import MergedColumnLinear, QKVLinear, RowLinear, VocabEmbedding, norm_product
from tidal.layers.moe import SparseMoE
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding
from tidal.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, input_size: int | None = None):
        super().__init__()
        self.attn = attn
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(input_size or config.hidden_size, config.head_dim, config.num_heads,
                                  config.num_kv_heads, config.attention_bias)
        # Qwen2 has bias on q/k/v only; the others put attention_bias on o_proj as well.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowLinear(config.num_heads * config.head_dim, config.hidden_size, o_bias)
        self.split = self.qkv_proj.local_sizes
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), rotary, batch, kv_cache)

    def attend(self, qkv: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch,
               kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention and the o product from the q|k|v product [T, (Hq + 2 Hkv) D] (the decoder
        layer computes it with its norm, `norm_product`)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)
        k = k.view(num_tokens, -1, self.head_dim)
        v = v.view(num_tokens, -1, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None  # the backend fuses them with rotary
        out = self.attn.forward(q, k, v, kv_cache, batch, self.scale, rotary, qk_norm=qk_norm)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP(norm(x + residual)), x + residual): the norm before the MLP rides in its
        gate|up product (with the SwiGLU, for one token on CUDA: `norm_product`)."""
        act, _, stream = norm_product(norm, x, residual, self.gate_up_proj, gated=True)
        return self.down_proj(act), stream


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, sparse: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attn)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if sparse:
            self.mlp = SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                 config.moe_intermediate_size, config.norm_topk_prob)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden, residual, rotary, batch, kv_cache):
        """(hidden, residual) -> (hidden, residual); the stream after the layer is their sum.
        residual None means hidden is the raw embedding (first layer)."""
        qkv, _, residual = norm_product(self.input_layernorm, hidden, residual, self.self_attn.qkv_proj)
        hidden = self.self_attn.attend(qkv, rotary, batch, kv_cache)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


# Checkpoint tensors fused into one of our parameters: our name -> [(checkpoint name, shard id)].
FUSED_PARAMS = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}


def fused_checkpoint_names(name: str) -> list[tuple[str, object]]:
    """Checkpoint tensors that make up parameter `name` (with the shard id to load them as)."""
    for fused, parts in FUSED_PARAMS.items():
        if f".{fused}." in name:
            return [(name.replace(fused, part), shard) for part, shard in parts]
    return [(name, None)]


class CausalLM(nn.Module):
    """Llama-family causal LM. Parameter names follow the Hugging Face checkpoint, minus
    the leading "model." and with q/k/v and gate/up fused."""

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attn, i in config.moe_layer_ids)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.aux_layer_ids: tuple[int, ...] = ()

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-normed hidden states [T, H]; with aux_layer_ids set, also the residual
        stream after each listed layer, concatenated to [T, len(ids) * H] (EAGLE-3 input)."""
        hidden, residual = self.embed_tokens(input_ids), None
        aux = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, self.rotary, batch, kv_caches[i])
            if i in self.aux_layer_ids:
                aux[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        if not self.aux_layer_ids:
            return hidden
        return hidden, torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [T, V] (on rank 0 alone, under tensor parallelism)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def checkpoint_names(self, name: str, available: set[str]) -> list[tuple[str, object]]:
        """The checkpoint tensors (and shard ids) that parameter `name` is loaded from, given
        the names the checkpoint has (`available`: experts are stored one by one or stacked)."""
        if name.startswith("lm_head."):
            return [(name, None)]
        if ".mlp.experts." in name or ".mlp.gate." in name:
            return _expert_checkpoint_names("model." + name, self.config, available)
        return [("model." + n, shard) for n, shard in fused_checkpoint_names(name)]


# Per-expert checkpoint names of the stacked gate|up (with its halves) and down projections.
_EXPERT_PARTS = {
    "MixtralForCausalLM": ("block_sparse_moe", [("w1", 0), ("w3", 1)], "w2"),
    "Qwen3MoeForCausalLM": ("mlp", [("gate_proj", 0), ("up_proj", 1)], "down_proj"),
}


def _expert_checkpoint_names(name: str, config: ModelConfig, available: set[str]) -> list[tuple[str, object]]:
    """`name` is model.layers.N.mlp.{gate.weight, experts.gate_up_proj, experts.down_proj}.
    A checkpoint that holds the stacked tensor under that name (transformers 5's own layout)
    loads it whole; else the experts one by one, under the family's published names
    (Mixtral's router and experts live in `block_sparse_moe`)."""
    if name in available:
        return [(name, None)]
    block, gate_up, down = _EXPERT_PARTS[config.architecture]
    prefix = name.split(".mlp.")[0] + f".{block}."
    if name.endswith(".gate.weight"):
        return [(prefix + "gate.weight", None)]
    experts = range(config.num_experts)
    if name.endswith(".gate_up_proj"):
        return [(f"{prefix}experts.{e}.{part}.weight", (e, half)) for e in experts for part, half in gate_up]
    return [(f"{prefix}experts.{e}.{down}.weight", e) for e in experts]
