"""The embedded default model, used when a command gets no --model.

Until the project ships a trained demo pair, this is a tiny Llama with RANDOM weights and a
byte-level BPE tokenizer trained on a few sentences: it exercises the whole engine (and
n-gram speculation) on any machine without downloading anything, but its text is noise.
It is written once into the user's cache folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEMO_NAME = "tidal-demo-random-v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The tide comes in and the tide goes out, and the engine keeps serving tokens.",
    "Speculative decoding drafts a few tokens cheaply and lets the large model verify them at once.",
    "When the server is idle it speculates hard; when it is busy it gets out of the way.",
    "A paged KV cache stores keys and values in fixed-size pages shared between requests.",
    "héllo wörld, naïve café: 日本語のテキスト 🙂 and some code: def f(x): return x * 2",
]


def default_model_dir() -> str:
    root = Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal")) / DEMO_NAME
    if not (root / "model.safetensors").exists():
        build_demo_model(root)
    return str(root)


def build_demo_model(path: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    special = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>", "eos_token": "<|end|>",
        "chat_template": CHAT_TEMPLATE}))
    vocab, hidden, inter, layers, heads, kv_heads = 512, 64, 128, 2, 4, 2
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * (1.0 / shape[-1] ** 0.5)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(weights, str(path / "model.safetensors"))
