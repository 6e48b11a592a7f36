"""The project-made tiny checkpoint: a seeded random Qwen2 model plus the offline tokenizer.

Invariants: no network; the same arguments write the same bytes; head_dim is 64 (vLLM's CPU
attention kernels accept it); the directory loads in the built-in engine, ``transformers`` and
vLLM.  Weights are scaled so activations keep unit size and logits are peaked (std ~3), which
keeps greedy decoding away from near-ties and makes attention, biases and norms matter.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from agentroll.engine.models.decoder import DecoderConfig, weight_shapes
from agentroll.errors import ConfigError

HEAD_DIM = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_weights(
    cfg: DecoderConfig,
    *,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights for ``cfg`` under checkpoint names (same seed, same values);
    ``progress(done, count)`` is called after each tensor when given.

    Projections into a layer have std 1/sqrt(fan_in); projections back into the residual
    stream are further divided by sqrt(2 * layers); biases and norm gains are perturbed so a
    runner that drops them disagrees with the reference; the LM head gives logits of std ~3.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    depth = math.sqrt(2 * cfg.num_layers)
    shapes = sorted(weight_shapes(cfg).items())
    for done, (name, shape) in enumerate(shapes, 1):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensor = noise
        elif name == "lm_head.weight":
            tensor = noise * (3.0 / math.sqrt(shape[1]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor = noise / (math.sqrt(shape[1]) * depth)
        else:
            tensor = noise / math.sqrt(shape[1])
        out[name] = tensor.contiguous()
        if progress is not None:
            progress(done, len(shapes))
    return out


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, object],
    tensors: dict[str, torch.Tensor],
    dtype: str = "float32",
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (tensors cast to ``dtype``)."""
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    cast = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in sorted(tensors.items())}
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def create_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab_size: int | None = None,
    max_position: int = 4096,
    dtype: str = "float32",
) -> Path:
    """Write a tiny Qwen2 checkpoint with the project tokenizer into ``out_dir``; return it.

    ``heads`` defaults to ``hidden // 64`` and must give head_dim 64; ``kv_heads`` defaults to
    half the heads (at least 1); ``intermediate`` to ``4 * hidden``; ``vocab_size`` to the
    tokenizer size rounded up to a multiple of 64.  Raises ConfigError for impossible shapes.
    Existing files of the same names are overwritten.
    """
    from agentroll.model.tokenizer import build_tokenizer, save_tokenizer

    heads = heads or max(1, hidden // HEAD_DIM)
    kv_heads = kv_heads or max(1, heads // 2)
    if hidden != heads * HEAD_DIM:
        raise ConfigError(
            f"hidden ({hidden}) must equal heads x 64 so head_dim is 64; "
            f"use hidden={heads * HEAD_DIM} or heads={max(1, hidden // HEAD_DIM)}"
        )
    if layers < 1 or heads % kv_heads:
        raise ConfigError("layers must be >= 1 and heads a multiple of kv_heads")
    tok = build_tokenizer()
    size = tok.get_vocab_size()
    vocab = vocab_size or -(-size // 64) * 64
    if vocab < size:
        raise ConfigError(f"vocab_size ({vocab}) must be >= the tokenizer size ({size})")
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config: dict[str, object] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "head_dim": HEAD_DIM,
        "initializer_range": 0.02,
        "intermediate_size": intermediate or 4 * hidden,
        "max_position_embeddings": max_position,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    cfg = DecoderConfig.from_dict(config)
    out = write_checkpoint(out_dir, config, random_weights(cfg, seed=seed), dtype)
    generation = {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(out)
    return out


def ensure_tiny_model(path: str | Path | None = None) -> Path:
    """The tiny model directory (created on first use)."""
    default = Path.home() / ".cache" / "agentroll" / "tiny-qwen2"
    p = Path(path) if path else Path(os.environ.get("AGENTROLL_TINY_MODEL", str(default)))
    if not (p / "model.safetensors").exists():
        create_tiny(p)
    return p
