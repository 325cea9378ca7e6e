"""ModelConfig: what the engine needs from a Hugging Face model folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tidal.layers.rotary import SUPPORTED_ROPE_TYPES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None        # None for plain rope, else {"rope_type": ..., parameters}
    max_position_embeddings: int     # longest context served exactly (capped by a sliding window)
    tie_word_embeddings: bool
    attention_bias: bool             # bias on the q/k/v projections (always on for Qwen2)
    qk_norm: bool                    # per-head RMSNorm of q and k before rotary (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # Mixture of experts (num_experts 0: a dense model): the layers whose MLP is a router over
    # num_experts SwiGLU experts of width moe_intermediate_size, num_experts_per_tok per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False     # renormalise the top-k routing weights to sum to one
    moe_layer_ids: tuple[int, ...] = ()

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model folder {str(model_dir)!r} does not exist: tidal reads checkpoints from a local "
                             "folder in the Hugging Face layout (config.json, *.safetensors, the tokenizer's files); "
                             "download one first, e.g. `huggingface-cli download ID --local-dir DIR`, and pass DIR")
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {str(model_dir)!r} has no config.json (a folder in the Hugging Face "
                             "layout is expected)")
        raw = json.loads(path.read_text())
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return ModelConfig.from_dict(raw, generation)

    @staticmethod
    def from_dict(raw: dict, generation: dict | None = None) -> "ModelConfig":
        """Parse a config.json dict (plus generation_config.json, whose eos ids are added:
        instruct models often list their end-of-turn token only there)."""
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
        if raw.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        rope_theta, rope_scaling = _parse_rope(raw)
        max_positions = raw["max_position_embeddings"]
        # Sliding-window attention is not implemented: serve only contexts the window covers.
        window = raw.get("sliding_window")
        if window and raw.get("use_sliding_window", True):
            max_positions = min(max_positions, window)
        return ModelConfig(
            **_parse_moe(arch, raw),
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=_merge_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        )


def _parse_moe(arch: str, raw: dict) -> dict:
    """The expert fields: Mixtral's every layer is sparse, its experts as wide as
    `intermediate_size`, its routing weights renormalised; Qwen3-MoE's layer i is sparse
    unless listed in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`
    (those keep a dense MLP of `intermediate_size`)."""
    num_layers = raw["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        moe = dict(num_experts=raw["num_local_experts"], moe_intermediate_size=raw["intermediate_size"],
                   norm_topk_prob=True, moe_layer_ids=tuple(range(num_layers)))
    elif arch == "Qwen3MoeForCausalLM":
        # (transformers 5 writes the expert count as num_local_experts; published configs as num_experts)
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        moe = dict(num_experts=num_experts, moe_intermediate_size=raw["moe_intermediate_size"],
                   norm_topk_prob=bool(raw.get("norm_topk_prob")),
                   moe_layer_ids=tuple(i for i in range(num_layers)
                                       if num_experts and i not in dense and (i + 1) % step == 0))
    else:
        return {}
    top_k = raw["num_experts_per_tok"]
    if moe["moe_layer_ids"] and not 0 < top_k <= moe["num_experts"]:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {moe['num_experts']}]")
    return {**moe, "num_experts_per_tok": top_k}


def _parse_rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys (where the type may be spelled "type")."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return float(theta), None if rope_type == "default" else {"rope_type": rope_type, **params}


def _merge_ids(*values) -> tuple[int, ...]:
    """Union of int-or-list id fields, in order of first appearance."""
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(i)
    return tuple(ids)
