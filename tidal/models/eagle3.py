"""EAGLE-3 drafter head, in the layout published by the EAGLE authors and SpecForge.

One Llama decoder layer whose attention reads [embed(token) | hidden] (width 2H). The
first draft step feeds the target's aux hidden states (3 layers, width 3*Ht) through `fc`;
later steps feed back the head's own residual stream (`prenorm`, width H). Logits cover a
smaller draft vocabulary; `d2t` maps a draft id to its target id (target = draft + d2t[draft]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from tidal.attention.base import AttentionBackend
from tidal.batch import ForwardBatch
from tidal.layers.linear import Linear, VocabEmbedding
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding
from tidal.models.config import ModelConfig
from tidal.models.llama import MLP, Attention, CausalLM, fused_checkpoint_names
from tidal.models.loader import build_on, checkpoint_tensor_names, fill_weights, init_dummy_weights, read_tensor

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig            # the draft layer's shapes (read as a one-layer Llama)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target layers to read, None = loader default

    @staticmethod
    def from_pretrained(model_dir: str | Path, target: ModelConfig | None = None) -> "Eagle3Config":
        """Read config.json. With `target` given, check the head fits that model and size
        its rotary table for the target's context (heads often declare a short one)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json")
        raw = json.loads(path.read_text())
        arch = (raw.get("architectures") or [None])[0]
        if arch != EAGLE3_ARCHITECTURE:
            raise ValueError(f"{model_dir} is not an EAGLE-3 head: architecture {arch!r}, expected {EAGLE3_ARCHITECTURE!r}")
        model = replace(ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}), architecture=arch)
        layer_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        cfg = Eagle3Config(
            model=model,
            draft_vocab_size=raw.get("draft_vocab_size") or model.vocab_size,
            target_hidden_size=raw.get("target_hidden_size") or model.hidden_size,
            aux_layer_ids=tuple(layer_ids) if layer_ids else None,
        )
        if target is None:
            return cfg
        cfg.check_target(target)
        max_positions = max(model.max_position_embeddings, target.max_position_embeddings)
        return replace(cfg, model=replace(model, max_position_embeddings=max_positions))

    def check_target(self, target: ModelConfig) -> None:
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != target hidden_size {target.hidden_size}")
        if self.model.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.model.vocab_size} != target vocab_size {target.vocab_size}")
        if self.draft_vocab_size > target.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} > target vocab_size {target.vocab_size}")
        bad_ids = [i for i in self.aux_layer_ids or () if not 0 <= i < target.num_layers]
        if bad_ids:
            problems.append(f"aux layer ids {bad_ids} outside the target's {target.num_layers} layers")
        if problems:
            raise ValueError("EAGLE-3 head does not fit the target model: " + "; ".join(problems))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, attn: AttentionBackend, target_embed: nn.Embedding | None):
        """target_embed: the target's embedding, used when the checkpoint has none of its
        own (None = the head owns and loads `embed_tokens`)."""
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.shares_embedding = target_embed is not None
        if target_embed is None:
            target_embed = nn.Embedding(m.vocab_size, m.hidden_size)
            target_embed.weight.requires_grad_(False)
        elif target_embed.weight.shape != (m.vocab_size, m.hidden_size):
            raise ValueError(
                f"EAGLE-3 head has no embed_tokens and the target's embedding {tuple(target_embed.weight.shape)} "
                f"does not match its vocab_size x hidden_size ({m.vocab_size}, {m.hidden_size})"
            )
        self.embed_tokens = target_embed
        self.fc = Linear(3 * cfg.target_hidden_size, m.hidden_size)
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.self_attn = Attention(m, attn, input_size=2 * m.hidden_size)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.mlp = MLP(m.hidden_size, m.intermediate_size)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = Linear(m.hidden_size, cfg.draft_vocab_size)
        self.rotary = RotaryEmbedding(m.head_dim, m.max_position_embeddings, m.rope_theta, m.rope_scaling)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(m.vocab_size, dtype=torch.bool))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for tokens [T] at batch.positions: hidden is the target's aux
        states [T, 3*Ht] or the previous step's prenorm [T, H]. Returns (norm(prenorm),
        prenorm), both [T, H]: the final norm adds the residual in the same kernel."""
        if hidden.shape[-1] == 3 * self.cfg.target_hidden_size:
            hidden = self.fc(hidden)
        size = hidden.shape[-1]
        x = torch.empty(hidden.shape[0], 2 * size, dtype=hidden.dtype, device=hidden.device)
        self.input_layernorm(self.embed_tokens(input_ids), out=x[:, :size])  # [embed | hidden], normed in place
        self.hidden_norm(hidden, out=x[:, size:])
        x = self.self_attn(x, self.rotary, batch, kv_cache)
        x, residual = self.mlp(x, hidden, self.post_attention_layernorm)
        return self.norm(x, residual)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] in float32, from `forward`'s normed states."""
        return self.lm_head(normed).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def checkpoint_names(self, name: str, available: set[str]) -> list[tuple[str, object]]:
        """The checkpoint tensors (and shard ids) of parameter `name` (the published layout
        has one, so `available` is not consulted)."""
        if name.startswith("embed_tokens.") and self.shares_embedding:
            return []
        if name.startswith(("self_attn.", "mlp.", "input_layernorm.", "hidden_norm.", "post_attention_layernorm.")):
            name = "midlayer." + name
        return fused_checkpoint_names(name)


def load_eagle3(
    model_dir: str | Path,
    target_model: CausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
    attn: AttentionBackend,
    load_format: str = "safetensors",
    target_dir: str | Path | None = None,
) -> Eagle3Head:
    """Load an EAGLE-3 head for `target_model`, whose embedding it shares if it has none of
    its own. The head runs whole on one rank, so where tensor parallelism split the target's
    embedding over the ranks, it reads a whole copy from `target_dir`, the target's checkpoint."""
    cfg = Eagle3Config.from_pretrained(model_dir, target_model.config)
    has_embedding = load_format != "dummy" and "embed_tokens.weight" in checkpoint_tensor_names(model_dir)
    with build_on(device, dtype):
        shared = None if has_embedding else target_model.embed_tokens
        if shared is not None and shared.tp_size > 1:
            shared = VocabEmbedding(cfg.model.vocab_size, target_model.config.hidden_size)
            if load_format == "dummy":
                init_dummy_weights(shared)
            else:
                shared.weight_loader(shared.weight, read_tensor(target_dir, "model.embed_tokens.weight"))
        head = Eagle3Head(cfg, attn, shared)
    fill_weights(head, model_dir, load_format)
    return head.eval()
