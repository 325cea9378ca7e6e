"""ModelConfig: what the engine needs from a Hugging Face model folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tidal.layers.rotary import SUPPORTED_ROPE_TYPES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


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
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=_merge_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        )


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
