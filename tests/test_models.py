"""The model side against Hugging Face transformers, on tiny random checkpoints."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from checkpoints import ARCHS, make_checkpoint, make_eagle3_checkpoint
from tidal import batch_kernels
from tidal.attention.torch_ref import TorchAttention
from tidal.batch import ForwardBatch, to_device_parts
from tidal.graphs import CudaGraphs
from tidal.layers.rotary import RotaryEmbedding
from tidal.models.config import ModelConfig
from tidal.models.eagle3 import Eagle3Config, load_eagle3
from tidal.models.loader import default_aux_layer_ids, load_model

PAGE_SIZE = 4
ATOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 250], list(range(100, 111)), [7, 300, 42, 8, 13, 21, 34, 55, 89, 144, 233, 377, 10, 11, 12, 6, 9]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, tied, sharded) -> folder, each written once per module."""
    cache = {}

    def get(arch: str, tied: bool = False, sharded: bool = False):
        key = (arch, tied, sharded)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}-{'sharded' if sharded else 'single'}")
            cache[key] = make_checkpoint(path, arch, tie_embeddings=tied, sharded=sharded)
        return cache[key]

    return get


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


class Runner:
    """A minimal runner: each request gets pages interleaved with the others' (so the
    page table matters) and tokens go through ForwardBatch.build."""

    def __init__(self, model, num_requests: int, max_len: int = 64):
        cfg = model.config
        self.model = model
        pages_each = math.ceil(max_len / PAGE_SIZE)
        self.pages = [[r + num_requests * j for j in range(pages_each)] for r in range(num_requests)]
        shape = (2, num_requests * pages_each, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(cfg.num_layers)]

    def step(self, tokens: list[list[int]], context_lens: list[int], requests: list[int] | None = None):
        """Run the given query tokens; returns per-request logits (and the batch output)."""
        requests = requests if requests is not None else list(range(len(tokens)))
        batch = ForwardBatch.build(tokens, context_lens, [self.pages[r] for r in requests], PAGE_SIZE, "cpu")
        with torch.no_grad():
            out = self.model(batch.input_ids, batch, self.kv_caches)
            hidden = out[0] if isinstance(out, tuple) else out
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(t) for t in tokens])), out


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_transformers(checkpoint, arch, tied, sharded):
    path = checkpoint(arch, tied, sharded)
    assert (path / "model.safetensors.index.json").is_file() == sharded
    model = load_model(path, torch.float32, "cpu", TorchAttention())
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head is None) == tied
    reference = hf_model(path)
    logits, _ = Runner(model, len(PROMPTS)).step(PROMPTS, [0] * len(PROMPTS))
    for prompt, got in zip(PROMPTS, logits):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, hf_logits(reference, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    model = load_model(path, torch.float32, "cpu", TorchAttention())
    reference = hf_model(path)
    runner = Runner(model, len(PROMPTS))
    splits = [2, 8, 9]
    runner.step([p[:s] for p, s in zip(PROMPTS, splits)], [0, 0, 0])
    # Second chunks of requests 0 and 2 only (request 1 sits this step out).
    logits, _ = runner.step([PROMPTS[0][2:], PROMPTS[2][9:]], [2, 9], requests=[0, 2])
    torch.testing.assert_close(logits[0], hf_logits(reference, PROMPTS[0])[2:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(reference, PROMPTS[2])[9:], atol=ATOL, rtol=0)
    # Request 1 finishes its prompt while 0 and 2 decode one token each.
    next_tokens = [int(logits[0][-1].argmax()), int(logits[1][-1].argmax())]
    logits, _ = runner.step(
        [[next_tokens[0]], PROMPTS[1][8:], [next_tokens[1]]],
        [len(PROMPTS[0]), 8, len(PROMPTS[2])],
    )
    torch.testing.assert_close(logits[0][-1], hf_logits(reference, PROMPTS[0] + [next_tokens[0]])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(reference, PROMPTS[1])[8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2][-1], hf_logits(reference, PROMPTS[2] + [next_tokens[1]])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "mixtral"])
def test_greedy_decode_matches_transformers_generate(checkpoint, arch):
    path = checkpoint(arch)
    model = load_model(path, torch.float32, "cpu", TorchAttention())
    prompt = PROMPTS[1]
    expected = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    runner = Runner(model, 1)
    tokens, context = list(prompt), 0
    while len(tokens) < expected.shape[1]:
        logits, _ = runner.step([tokens[context:]], [context])
        context = len(tokens)
        tokens.append(int(logits[0][-1].argmax()))
    assert tokens == expected[0].tolist()
    assert len(set(tokens[len(prompt):])) > 4, "tiny model collapsed onto a repeated token"


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "mistral"])
def test_one_token_kernels_decode_as_the_modules(checkpoint, arch, monkeypatch):
    """A one-token decode through the kernels CUDA runs it with (the add and norm in the
    q|k|v, gate|up and router products, `norm_product`; the GEMVs after attention), run here
    through Triton's interpreter, gives the modules' logits: the layers hand the norms, the
    residual stream and the normed tokens on as the unfused path does. (Mistral's decoder is
    Llama's layer for layer: its case ran llama's kernels again, 8-11 s in the interpreter.)"""
    pytest.importorskip("triton")
    from tidal.layers import linear

    model = load_model(checkpoint(arch), torch.float32, "cpu", TorchAttention())
    prompt = PROMPTS[2]
    want, got = Runner(model, 1), Runner(model, 1)
    for runner in (want, got):
        runner.step([prompt[:-1]], [0])
    expected, _ = want.step([prompt[-1:]], [len(prompt) - 1])
    monkeypatch.setattr(linear, "one_token_on_cuda", lambda x: x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1)
    # Several rows of W a program, as norm_gemv_tiles takes them for long outputs (2 gated
    # pairs, or 4 rows): a tiny model's products would run a row a program, and each of
    # the interpreter's programs takes milliseconds. The tiles themselves are
    # test_fused_ops' (test_norm_gemv_is_the_add_the_norm_and_the_product); here, what the
    # layers hand on.
    from tidal.layers import fused

    monkeypatch.setattr(fused, "norm_gemv_tiles", lambda n, k, gated: (2 if gated else 4, 4))
    logits, _ = got.step([prompt[-1:]], [len(prompt) - 1])
    torch.testing.assert_close(logits[0], expected[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_aux_hidden_states_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    model = load_model(path, torch.float32, "cpu", TorchAttention())
    model.aux_layer_ids = (2, 0, 1)
    reference = hf_model(path)
    _, (hidden, aux) = Runner(model, len(PROMPTS)).step(PROMPTS, [0] * len(PROMPTS))
    H = model.config.hidden_size
    assert aux.shape == (hidden.shape[0], 3 * H)
    for prompt, got in zip(PROMPTS, aux.split([len(p) for p in PROMPTS])):
        with torch.no_grad():
            states = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(model.aux_layer_ids):
            torch.testing.assert_close(got[:, k * H : (k + 1) * H], states[layer + 1][0], atol=ATOL, rtol=0)


def stacked_experts(path, out):
    """A copy of the MoE checkpoint at `path` whose experts are stacked as transformers 5
    holds them in memory (model.layers.N.mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I], router model.layers.N.mlp.gate.weight)."""
    shutil.copytree(path, out, dirs_exist_ok=True)
    tensors = load_file(out / "model.safetensors")
    parts = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    per_expert = {}
    for name in [n for n in tensors if ".experts." in n or "block_sparse_moe.gate" in n]:
        tensor = tensors.pop(name)
        layer = name.split(".")[2]
        if name.endswith("gate.weight"):
            tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensor
            continue
        expert, part = int(name.split(".")[-3]), name.split(".")[-2]
        per_expert.setdefault((layer, parts.get(part, part)), {})[expert] = tensor
    for layer in sorted({layer for layer, _ in per_expert}):
        def stack(part):
            experts = per_expert[(layer, part)]
            return torch.stack([experts[e] for e in sorted(experts)])
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = stack("down_proj")
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("variant", ["norm_topk_prob", "stacked-qwen3moe", "stacked-mixtral"])
def test_moe_variants_match_transformers(tmp_path, checkpoint, variant):
    """Qwen3-MoE with renormalised routing weights, and checkpoints whose experts are
    stacked (transformers 5's own layout) instead of stored one by one."""
    if variant == "norm_topk_prob":
        path = make_checkpoint(tmp_path, "qwen3moe", norm_topk_prob=True)
        assert ModelConfig.from_pretrained(path).norm_topk_prob
        reference = hf_model(path)
    else:
        original = checkpoint(variant.removeprefix("stacked-"))
        path, reference = stacked_experts(original, tmp_path / "stacked"), hf_model(original)
    model = load_model(path, torch.float32, "cpu", TorchAttention())
    logits, _ = Runner(model, len(PROMPTS)).step(PROMPTS, [0] * len(PROMPTS))
    for prompt, got in zip(PROMPTS, logits):
        torch.testing.assert_close(got, hf_logits(reference, prompt), atol=ATOL, rtol=0)


def test_moe_routes_tokens_to_many_experts(checkpoint):
    """The parity tests above mean something only if the tiny models' routers spread the
    tokens (and renormalise where they should)."""
    for arch in ("qwen3moe", "mixtral"):
        model = load_model(checkpoint(arch), torch.float32, "cpu", TorchAttention())
        moe = model.layers[1].mlp
        weights, ids = moe.route(torch.randn(64, model.config.hidden_size))
        assert len(ids.unique()) == model.config.num_experts
        sums = weights.sum(-1)
        if moe.norm_topk_prob:
            torch.testing.assert_close(sums, torch.ones_like(sums))
        else:
            assert (sums < 1).all()


def test_moe_config_fields(checkpoint):
    qwen = ModelConfig.from_pretrained(checkpoint("qwen3moe"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.moe_layer_ids == (1, 2, 3) and qwen.qk_norm and not qwen.norm_topk_prob
    raw = json.loads((checkpoint("qwen3moe") / "config.json").read_text())
    raw.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=raw.pop("num_local_experts"))
    assert ModelConfig.from_dict(raw).moe_layer_ids == (1, 5)
    mixtral = ModelConfig.from_pretrained(checkpoint("mixtral"))
    assert mixtral.moe_layer_ids == (0, 1, 2, 3) and mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 64
    assert ModelConfig.from_pretrained(checkpoint("llama")).moe_layer_ids == ()
    raw["num_experts_per_tok"] = 9
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        ModelConfig.from_dict(raw)


def test_moe_checkpoint_with_a_wrong_expert_shape(tmp_path, checkpoint):
    shutil.copytree(checkpoint("qwen3moe"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj.*shape mismatch"):
        load_model(tmp_path, torch.float32, "cpu", TorchAttention())


def test_checkpoint_tokenizer_fits_the_model(checkpoint):
    path = checkpoint("qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == ModelConfig.from_pretrained(path).vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = "Hello there, speculative world!"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>hi\n<|assistant|>"


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (1, 15, 28)
    assert default_aux_layer_ids(8) == (1, 3, 4)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0}, {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}])
def test_rotary_tables_match_transformers(rope):
    hf_config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_theta": 500000.0, **(rope or {"rope_type": "default"})},
    )
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(300)
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(64, 512, 500000.0, rope)
    our_cos, our_sin = ours.cos_sin[positions].chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat([our_cos, our_cos], -1), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([our_sin, our_sin], -1), sin[0], atol=1e-6, rtol=0)


def test_config_reads_old_and_new_rope_keys(checkpoint):
    new = ModelConfig.from_pretrained(checkpoint("llama"))
    assert new.rope_scaling["rope_type"] == "llama3" and new.rope_theta == 10000.0
    raw = json.loads((checkpoint("llama") / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    old = ModelConfig.from_dict(raw)
    assert old.rope_theta == 500000.0 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    raw["rope_scaling"] = None
    assert ModelConfig.from_dict(raw).rope_scaling is None
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(raw)


def test_config_fields(checkpoint):
    qwen2 = ModelConfig.from_pretrained(checkpoint("qwen2"))
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_pretrained(checkpoint("qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 16
    assert qwen3.eos_token_ids == (2,) and qwen3.bos_token_id == 1
    assert qwen3.num_heads == 4 and qwen3.num_kv_heads == 2 and qwen3.vocab_size == 384
    raw = json.loads((checkpoint("mistral") / "config.json").read_text())
    raw["sliding_window"] = 100
    assert ModelConfig.from_dict(raw, {"eos_token_id": [2, 7]}).max_position_embeddings == 100
    assert ModelConfig.from_dict(raw, {"eos_token_id": [2, 7]}).eos_token_ids == (2, 7)


def test_unsupported_architecture(tmp_path, checkpoint):
    shutil.copytree(checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu", TorchAttention())


def test_missing_tensor(tmp_path, checkpoint):
    shutil.copytree(checkpoint("qwen2"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, torch.float32, "cpu", TorchAttention())


def test_bfloat16_model_runs(checkpoint):
    path = checkpoint("llama")
    model = load_model(path, torch.bfloat16, "cpu", TorchAttention())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rotary.cos_sin.dtype == torch.float32
    runner = Runner(model, len(PROMPTS))
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    logits, _ = runner.step(PROMPTS, [0] * len(PROMPTS))
    reference = hf_logits(hf_model(path), PROMPTS[2])
    assert (logits[2].argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


def eagle3_reference(tensors: dict, embed: torch.Tensor, head_dim: int, tokens: list[int], hidden: torch.Tensor):
    """One EAGLE-3 layer over a whole sequence (hidden already of width H), written from
    the raw checkpoint tensors: returns (prenorm, draft logits)."""
    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    w = {k.removeprefix("midlayer."): v for k, v in tensors.items()}
    x = torch.cat([rms(embed[tokens], w["input_layernorm.weight"]), rms(hidden, w["hidden_norm.weight"])], -1)
    T = len(tokens)
    q, k, v = ((x @ w[f"self_attn.{p}_proj.weight"].T).view(T, -1, head_dim).transpose(0, 1) for p in "qkv")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(T).float()[:, None] * inv_freq
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    attn = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
    h = attn.transpose(0, 1).reshape(T, -1) @ w["self_attn.o_proj.weight"].T + hidden
    m = rms(h, w["post_attention_layernorm.weight"])
    prenorm = (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T + h
    return prenorm, rms(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("with_embedding", [True, False], ids=["own-embedding", "shared-embedding"])
def test_eagle3_head_matches_reference(tmp_path, checkpoint, with_embedding):
    target_path = checkpoint("llama")
    target = load_model(target_path, torch.float32, "cpu", TorchAttention())
    draft_path = make_eagle3_checkpoint(tmp_path, target_path, with_embedding=with_embedding, aux_layer_ids=(0, 1, 2))
    head = load_eagle3(draft_path, target, torch.float32, "cpu", TorchAttention())
    assert (head.embed_tokens is target.embed_tokens) != with_embedding
    assert head.cfg.aux_layer_ids == (0, 1, 2) and head.cfg.draft_vocab_size == 128
    tensors = load_file(draft_path / "model.safetensors")
    embed = tensors["embed_tokens.weight"] if with_embedding else target.embed_tokens.weight
    # The target's prefill gives the aux states; the drafter absorbs all but the last
    # token from them, then takes one step fed with its own prenorm state.
    target.aux_layer_ids = head.cfg.aux_layer_ids
    tokens = PROMPTS[2]
    _, (_, aux) = Runner(target, 1).step([tokens], [0])
    n = len(tokens) - 1
    cfg = head.cfg.model
    kv_cache = torch.zeros(2, 8, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    pages = [[3, 1, 4, 0, 5, 2]]
    with torch.no_grad():
        batch = ForwardBatch.build([tokens[:n]], [0], pages, PAGE_SIZE, "cpu")
        first_normed, first = head(batch.input_ids, aux[:n], batch, kv_cache)
        batch = ForwardBatch.build([tokens[n:]], [n], pages, PAGE_SIZE, "cpu")
        second_normed, second = head(batch.input_ids, first[-1:], batch, kv_cache)
        logits = head.compute_logits(torch.cat([first_normed, second_normed]))
        hidden = torch.cat([aux[:n] @ tensors["fc.weight"].T, first[-1:]])
        ref_prenorm, ref_logits = eagle3_reference(tensors, embed, cfg.head_dim, tokens, hidden)
    torch.testing.assert_close(torch.cat([first, second]), ref_prenorm, atol=ATOL, rtol=0)
    assert logits.shape == (len(tokens), 128) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    target_ids = head.draft_to_target(logits.argmax(-1))
    assert bool(head.t2d[target_ids].all()) and int(target_ids.max()) < target.config.vocab_size


def test_eagle3_config_errors(tmp_path, checkpoint):
    target_path = checkpoint("llama")
    target_cfg = ModelConfig.from_pretrained(target_path)
    draft_path = make_eagle3_checkpoint(tmp_path / "head", target_path)
    cfg = Eagle3Config.from_pretrained(draft_path, target_cfg)
    assert cfg.aux_layer_ids is None and cfg.target_hidden_size == target_cfg.hidden_size
    assert cfg.model.max_position_embeddings == target_cfg.max_position_embeddings
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        Eagle3Config.from_pretrained(target_path)
    raw = json.loads((draft_path / "config.json").read_text())
    raw.update(target_hidden_size=96, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9]})
    (draft_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"target_hidden_size 96.*aux layer ids \[9\]"):
        Eagle3Config.from_pretrained(draft_path, target_cfg)


def test_advance_moves_each_row_to_its_next_position_until_its_limit():
    """A drafter's later steps move one batch on in place instead of building a new one; it
    must equal the batch built at the next positions, across page boundaries, and a row
    at its limit stays put and stores nothing."""
    pages = [[3, 1, 4], [5, 2], [7, 6, 8]]
    batch = ForwardBatch.build([[0]] * 3, [2, 3, 6], pages, PAGE_SIZE, "cpu")
    limits = torch.tensor([6, 5, 8])
    for step in range(1, 5):
        batch.advance(limits, PAGE_SIZE)
        positions = [min(p + step, limit - 1) for p, limit in zip([2, 3, 6], limits.tolist())]
        built = ForwardBatch.build([[0]] * 3, positions, pages, PAGE_SIZE, "cpu")
        live = [p + step < limit for p, limit in zip([2, 3, 6], limits.tolist())]
        assert batch.positions.tolist() == built.positions.tolist()
        assert batch.seq_lens.tolist() == built.seq_lens.tolist()
        assert batch.slot_mapping.tolist() == [s if ok else -1 for s, ok in zip(built.slot_mapping.tolist(), live)]
    assert batch.positions.tolist() == [5, 4, 7]
    # The kernel CUDA runs instead (here through Triton's interpreter) does the same, for
    # more rows than a kernel block too.
    pages, starts = pages * 7, [2, 3, 6] * 7
    limits = limits.repeat(7)
    kernel = ForwardBatch.build([[0]] * 21, starts, pages, PAGE_SIZE, "cpu")
    eager = ForwardBatch.build([[0]] * 21, starts, pages, PAGE_SIZE, "cpu")
    for _ in range(4):
        batch_kernels.advance(limits, kernel.seq_lens, kernel.positions, kernel.slot_mapping, kernel.page_table, PAGE_SIZE)
        eager.advance(limits, PAGE_SIZE)
        for field in ("positions", "seq_lens", "slot_mapping"):
            assert getattr(kernel, field).tolist() == getattr(eager, field).tolist(), field


def test_move_back_puts_rows_where_they_really_are():
    """A step planned ahead of a drafting one is built as if every draft were accepted,
    then moved back on the device by the drafts rejected: it must equal the batch built at
    the real positions, across page boundaries, with padding still storing nowhere."""
    # (The last row is a prompt admitted beside them: more tokens than a kernel block, none rejected.)
    pages = [[3, 1, 4], [5, 2], [7, 6, 8], [9, 10, 11, 12, 13, 14]]
    feeds, contexts, rejected = [[0, 0, 0], [0], [0, 0], [0] * 21], [5, 3, 8, 0], [2, 0, 3, 0]
    batch = ForwardBatch.build(feeds, contexts, pages, PAGE_SIZE, "cpu", pad_tokens=32)
    batch.move_back(torch.tensor(rejected), PAGE_SIZE)
    real = [c - r for c, r in zip(contexts, rejected)]
    built = ForwardBatch.build(feeds, real, pages, PAGE_SIZE, "cpu", pad_tokens=32)
    for field in ("positions", "seq_lens", "slot_mapping", "query_start_loc", "last_index"):
        assert getattr(batch, field).tolist() == getattr(built, field).tolist(), field
    assert batch.slot_mapping.tolist()[-2:] == [-1, -1]
    # The kernel CUDA runs instead (here through Triton's interpreter) does the same.
    kernel = ForwardBatch.build(feeds, contexts, pages, PAGE_SIZE, "cpu", pad_tokens=32)
    batch_kernels.move_back(torch.tensor(rejected), kernel.query_start_loc, kernel.seq_lens, kernel.positions,
                    kernel.slot_mapping, kernel.page_table, PAGE_SIZE)
    for field in ("positions", "seq_lens", "slot_mapping"):
        assert getattr(kernel, field).tolist() == getattr(built, field).tolist(), field


def test_graph_inputs_equal_the_built_batch():
    """A graph's inputs are filled from the host in three copies into a layout that depends
    on the graph's shape; what the graph reads must be the batch `ForwardBatch.build` makes,
    padded with requests and tokens that attend to nothing and store nowhere."""
    graphs = CudaGraphs(None, PAGE_SIZE, max_model_len=64, max_batch=8, max_width=3, device=torch.device("cpu"))
    graphs.load([[1, 2, 3]] * 7, [5] * 7, [[9, 9]] * 7, 3)  # another shape's layout first
    feeds, contexts, pages = [[5, 6], [7, 8], [9, 10]], [3, 9, 0], [[3, 1, 4], [5, 2, 6], [7]]
    key = graphs.load(feeds, contexts, pages, 2, input_ids=torch.tensor([11, 12, 13, 14, 15, 16]))
    assert key == (4, 2)
    view, built = graphs.view(*key), ForwardBatch.build(feeds, contexts, pages, PAGE_SIZE, "cpu")
    assert view.input_ids.tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert view.positions[:6].tolist() == built.positions.tolist()
    assert view.slot_mapping.tolist() == built.slot_mapping.tolist() + [-1, -1]
    assert view.query_start_loc.tolist() == built.query_start_loc.tolist() + [6]
    assert view.seq_lens.tolist() == built.seq_lens.tolist() + [0]
    assert view.page_table[:3, :3].tolist() == built.page_table.tolist()


def test_advance_on_graph_inputs_leaves_padding_rows_alone():
    """The draft graph advances its own inputs: padding rows (limit 0) keep an empty context
    and store nowhere while the real rows move on, each until its own limit."""
    graphs = CudaGraphs(None, PAGE_SIZE, max_model_len=64, max_batch=8, max_width=1, device=torch.device("cpu"))
    pages = [[3, 1, 4], [5, 2], [7, 6]]
    assert graphs.load([[0]] * 3, [2, 3, 5], pages, 1) == (4, 1)  # one padding row
    view = graphs.view(4, 1)
    for _ in range(2):
        view.advance(torch.tensor([6, 6, 7, 0]), PAGE_SIZE)
    built = ForwardBatch.build([[0]] * 3, [4, 5, 6], pages, PAGE_SIZE, "cpu")
    assert view.positions.tolist() == built.positions.tolist() + [0]
    assert view.seq_lens.tolist() == built.seq_lens.tolist() + [0]
    # Rows 0 and 1 moved twice; row 2 reached its limit after one move and stores nowhere.
    assert view.slot_mapping.tolist() == built.slot_mapping.tolist()[:2] + [-1, -1]


def test_parts_copied_together_each_start_aligned():
    """Host lists copied in one go keep their values, and each part starts 16-byte aligned
    whatever the lengths before it: a kernel reading a part is built for its pointer's
    alignment, and a part at an odd offset would build another while serving."""
    parts = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9], [10]]
    for dtype in (torch.int64, torch.int32):
        got = to_device_parts(parts, dtype, "cpu")
        assert [t.tolist() for t in got] == parts and all(t.dtype == dtype for t in got)
        assert all(t.data_ptr() % 16 == 0 for t in got)
