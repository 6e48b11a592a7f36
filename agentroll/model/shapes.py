"""Named model shapes for benchmarks: real architectures' sizes with seeded random weights.

``SHAPES`` is a pure table; ``shape_config`` turns an entry into a ``config.json`` that the
built-in engine, ``transformers`` and vLLM load.  ``ensure_shape_model`` writes the checkpoint
once (offline, seeded, with the project tokenizer) under a directory named by a hash of its
config, atomically: a killed run leaves no half checkpoint, and a finished one is reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentroll.engine.models.decoder import DecoderConfig, weight_shapes
from agentroll.errors import ConfigError

TOKENIZER_VOCAB = 2048  # the project tokenizer's size (ids past it are never prompted)
_RECIPE = 1  # bump when random_weights or the files written change: new cache directories


@dataclass(frozen=True, slots=True)
class Shape:
    """A decoder's shape; ``reference_params`` is the named model's published parameter count
    (None for the project's own tiny model)."""

    name: str
    architecture: str  # a key of decoder.ARCHITECTURES
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    reference_params: int | None = None


SHAPES: dict[str, Shape] = {
    # the project's tiny Qwen2 model (agentroll.model.tiny.create_tiny's defaults)
    "tiny": Shape("tiny", "Qwen2ForCausalLM", 128, 2, 2, 1, 512, 2048, False, 1e4, 1e-6, 4096),
    # HuggingFaceTB/SmolLM2-360M: 361,821,120 parameters
    "smollm2-360m": Shape(
        "smollm2-360m", "LlamaForCausalLM", 960, 32, 15, 5, 2560, 49152, True, 1e5, 1e-5, 8192,
        361_821_120,
    ),
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (its llama3 RoPE scaling is left out:
    # the engine runs default RoPE, and scaling does not change a step's cost)
    "llama-1b": Shape(
        "llama-1b", "LlamaForCausalLM", 2048, 16, 32, 8, 8192, 128256, True, 5e5, 1e-5, 131072,
        1_235_814_400,
    ),
}  # fmt: skip


def get_shape(name: str) -> Shape:
    """The shape called ``name``; raises ConfigError listing the known names."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ConfigError(f"unknown shape {name!r}; use one of {', '.join(SHAPES)}") from None


def shape_config(shape: Shape, *, eos_id: int = 2, pad_id: int = 0) -> dict[str, object]:
    """The ``config.json`` of ``shape`` (fp32), with the tokenizer's end and pad ids."""
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[shape.architecture]
    config: dict[str, object] = {
        "architectures": [shape.architecture],
        "model_type": model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "head_dim": shape.hidden // shape.heads,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": shape.max_position,
        "mlp_bias": False,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": shape.vocab,
    }
    if model_type == "qwen2":
        config.update(max_window_layers=shape.layers, sliding_window=None, use_sliding_window=False)
        del config["attention_bias"], config["mlp_bias"]
    return config


def num_params(cfg: DecoderConfig) -> int:
    """Parameters of a checkpoint for ``cfg`` (a tied head counted once)."""
    return sum(math.prod(s) for s in weight_shapes(cfg).values())


def cache_dir_name(shape: Shape, config: dict[str, object], seed: int) -> str:
    """``<name>-<12 hex>``: the hash covers the config, the seed and the weights recipe."""
    blob = json.dumps({"config": config, "seed": seed, "recipe": _RECIPE}, sort_keys=True)
    return f"{shape.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(root: Path, name: str) -> None:
    """Remove ``atomic_dir`` leftovers of ``name`` whose writer process is gone."""
    prefix = f".{name}.tmp"
    for partial in root.glob(f"{prefix}*"):
        pid = partial.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def ensure_shape_model(
    name: str,
    *,
    cache: str | Path | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _msg: None,
    shape: Shape | None = None,
) -> Path:
    """The checkpoint directory of shape ``name`` (``shape`` overrides the table entry),
    written on first use under ``cache`` (default ``~/.cache/agentroll/shapes``).

    ``tiny`` is the project's tiny model (``ensure_tiny_model``).  Writing goes to a
    temporary sibling directory renamed into place when complete, so an interrupted write
    (even SIGKILL) leaves nothing under the final name; its leftovers are removed by the
    next call.  ``progress`` gets one line per stage.  Raises ConfigError for an unknown name.
    """
    shape = shape or get_shape(name)
    if shape.name == "tiny" and shape == SHAPES["tiny"]:
        from agentroll.model.tiny import ensure_tiny_model

        return ensure_tiny_model(None)
    from agentroll._fs import atomic_dir
    from agentroll.model.tiny import random_weights, write_checkpoint
    from agentroll.model.tokenizer import build_tokenizer, save_tokenizer

    tok = build_tokenizer(TOKENIZER_VOCAB)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    if eos is None or pad is None:
        raise ConfigError("the project tokenizer lacks <|im_end|> or <|endoftext|>")
    config = shape_config(shape, eos_id=eos, pad_id=pad)
    root = Path(cache) if cache else Path.home() / ".cache" / "agentroll" / "shapes"
    final = root / cache_dir_name(shape, config, seed)
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, final.name)
    cfg = DecoderConfig.from_dict(config)
    total = num_params(cfg)
    progress(f"creating {shape.name} ({total / 1e6:.1f}M parameters, seed {seed}) in {final}")
    with atomic_dir(final) as tmp:

        def step(done: int, count: int) -> None:
            if done == count or done % max(1, count // 8) == 0:
                progress(f"random weights: {done}/{count} tensors")

        tensors = random_weights(cfg, seed=seed, progress=step)
        progress(f"writing model.safetensors ({4 * total / 2**30:.2f} GiB, fp32)")
        write_checkpoint(tmp, config, tensors)
        del tensors
        generation = {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        save_tokenizer(tmp, TOKENIZER_VOCAB)
    progress(f"created {final}")
    return final


__all__ = [
    "SHAPES",
    "TOKENIZER_VOCAB",
    "Shape",
    "cache_dir_name",
    "ensure_shape_model",
    "get_shape",
    "num_params",
    "shape_config",
]
