"""Shapes and checkpoints the GPU benchmarks share: the Llama-3.1-8B and Qwen3-30B-A3B shapes
(and tiny ones for CPU smoke runs) as config-only model folders, for `load_format="dummy"`
(random weights).

    python benchmarks/common.py DIR [8b|smoke|moe|smoke-moe]   # DIR/target and DIR/eagle3
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "tidal" / "demo_pair"  # this tree's, whichever tidal runs

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# Qwen3-30B-A3B: 48 layers, 128 experts of width 768, 8 per token (every layer sparse).
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)
SMOKE_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=64,
                 intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False)


def write_model_dir(root: Path, shape: dict) -> Path:
    """config.json of the given shape (a Llama unless it names its architectures) plus the
    demo tokenizer (prompts are token ids)."""
    path = root / "target"
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / name, path / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 0,
              "eos_token_id": 1, "torch_dtype": "bfloat16", **shape}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_eagle_dir(root: Path, shape: dict) -> Path:
    path = root / "eagle3"
    path.mkdir(parents=True, exist_ok=True)
    config = {**shape, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1}
    config["draft_vocab_size"] = min(32000, shape["vocab_size"])
    (path / "config.json").write_text(json.dumps(config))
    return path


SHAPES = {"8b": LLAMA_8B, "smoke": SMOKE, "moe": QWEN3_30B_A3B, "smoke-moe": SMOKE_MOE}

if __name__ == "__main__":  # python3 benchmarks/common.py DIR [8b|smoke|moe|smoke-moe]
    root, shape = Path(sys.argv[1]), SHAPES[sys.argv[2] if len(sys.argv) > 2 else "8b"]
    print(write_model_dir(root, shape), write_eagle_dir(root, shape))
