"""Build models straight on their device and dtype, and fill them from safetensors files."""

from __future__ import annotations

import json
import zlib
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tidal.attention.base import AttentionBackend
from tidal.layers.linear import default_weight_loader
from tidal.models.config import ModelConfig
from tidal.models.llama import CausalLM


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Layers whose output an EAGLE-3 drafter reads when its config does not say: one low,
    one middle and one high layer, as in the EAGLE-3 reference setup."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@contextmanager
def build_on(device: torch.device | str, dtype: torch.dtype):
    """Create parameters directly on `device` in `dtype` (no CPU copy, no second cast)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, attn: AttentionBackend,
    load_format: str = "safetensors",
) -> CausalLM:
    config = ModelConfig.from_pretrained(model_dir)
    with build_on(device, dtype):
        model = CausalLM(config, attn)
    fill_weights(model, model_dir, load_format)
    return model.eval()


def fill_weights(module: nn.Module, model_dir: str | Path, load_format: str) -> None:
    if load_format == "safetensors":
        load_weights(module, model_dir)
    elif load_format == "dummy":
        init_dummy_weights(module)
    else:
        raise ValueError(f"load_format: unknown format {load_format!r} (expected 'safetensors' or 'dummy')")


@torch.no_grad()
def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Random weights for speed measurements (only config.json is read): small normal
    matrices, unit norms, zero integer buffers (an EAGLE-3 d2t of zeros maps draft id i
    to target id i). Each matrix is seeded by its name's CRC, the same in every process, so
    runs repeat and tensor-parallel ranks hold the same replicated weights (an MoE router
    that differed between ranks would route each rank's tokens apart)."""
    for name, tensor in module.state_dict().items():
        if not tensor.is_floating_point():
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0 if "norm" in name else 0.0)
        else:
            g = torch.Generator(tensor.device).manual_seed(seed + zlib.crc32(name.encode()))
            tensor.normal_(0.0, 0.02, generator=g)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: one model.safetensors, or the shards its
    index lists."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def read_tensor(model_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint."""
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}")


@torch.no_grad()
def load_weights(module: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter and persistent buffer of `module` from the checkpoint.

    `module.checkpoint_names(name, available)` lists the checkpoint tensors (with shard
    ids) a parameter is made of, given the names the checkpoint has; each goes through the parameter's `weight_loader` (plain copy
    if it has none). Checkpoint tensors nobody asks for are ignored (e.g. lm_head.weight
    of a tied model); a tensor that is asked for and absent is a ValueError."""
    with ExitStack() as stack:
        where = {}
        for path in checkpoint_files(model_dir):
            f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            where.update(dict.fromkeys(f.keys(), f))
        for name, param in module.state_dict(keep_vars=True).items():
            loader = getattr(param, "weight_loader", None)
            for ckpt_name, shard_id in module.checkpoint_names(name, where.keys()):
                if ckpt_name not in where:
                    raise ValueError(f"checkpoint {model_dir} is missing tensor {ckpt_name!r}")
                tensor = where[ckpt_name].get_tensor(ckpt_name)
                try:
                    if loader is None:
                        default_weight_loader(param, tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{ckpt_name}: {e}") from e
