"""Tiny random checkpoints in the Hugging Face layout, written by transformers itself, so
tests compare tidal against the reference implementation on the real file format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3moe", "mixtral")

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "It was the best of times, it was the worst of times.",
    "Speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "The scheduler batches requests, the runner executes them on the GPU.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Numbers like 12345 and 67890 appear in text, as do symbols: @#$%^&*().",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384) -> None:
    """Byte-level BPE of exactly `vocab_size` tokens (any text encodes), with <s>/</s>
    and a small chat template, saved as tokenizer.json + tokenizer_config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    # A small corpus can run out of merges: top up with plain tokens to the exact size.
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 4,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_kv_heads: int = 2,
    tie_embeddings: bool = False,
    sharded: bool = False,
    tokenizer: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    norm_topk_prob: bool = False,
) -> Path:
    """Write a random `arch` model (Hugging Face layout) to out_dir and return it.

    llama gets llama3 rope scaling with a short original context, so the scaling matters
    at test lengths. `sharded` saves several safetensors files plus an index. qwen3moe has
    8 experts, 2 per token, a dense first layer (`mlp_only_layers`) and `norm_topk_prob` as
    given; mixtral 4 experts, 2 per token. Every model has 4 query heads."""
    config_cls, model_cls = _CLASSES[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None
    if arch == "qwen3moe":
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                      decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=norm_topk_prob)
    if arch == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=hidden_size)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    randomize_(model, seed)
    out_dir = Path(out_dir)
    model.to(dtype).save_pretrained(out_dir, max_shard_size="100KB" if sharded else "10GB")
    if tokenizer:
        make_tokenizer(out_dir, vocab_size)
    return out_dir


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise with weights large enough that greedy decoding wanders instead of
    repeating one token (the default std of 0.02 makes tiny models constant), and with
    norm weights and biases away from 1 and 0 so that loading them wrongly shows."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif p.dim() == 1:
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(2.0 * noise / p.shape[1] ** 0.5)


def make_eagle3_checkpoint(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    draft_vocab_size: int = 128,
    with_embedding: bool = True,
    aux_layer_ids: tuple[int, ...] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random EAGLE-3 head for the target at target_dir, in the published layout
    (config.json with LlamaForCausalLMEagle3, model.safetensors with fc / midlayer / d2t / t2d)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}

    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(size, generator=gen)

    # The draft vocabulary: a sorted subset of target ids (always keeping the specials).
    chosen = torch.randperm(vocab - 3, generator=gen)[: draft_vocab_size - 3] + 3
    draft_to_target = torch.cat([torch.arange(3), chosen.sort().values])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors = {
        "fc.weight": matrix(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": matrix(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.up_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, inter),
        "norm.weight": norm(hidden),
        "lm_head.weight": matrix(draft_vocab_size, hidden),
        "d2t": draft_to_target - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir
