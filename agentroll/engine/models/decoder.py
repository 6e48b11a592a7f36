"""One generic decoder-only transformer (Llama, Qwen2, Qwen3) and its safetensors loader.

Invariants: parameters carry Hugging Face names; the math is written against :class:`Ops`,
so this file never chooses kernels nor touches the KV cache; for the same weights and tokens
it computes what ``transformers`` computes, up to rounding; checkpoint problems raise
:class:`ConfigError` naming the file, field or tensor; pickled checkpoints are never loaded.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agentroll._fs import read_json_object
from agentroll.errors import ConfigError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Static shape and numerics of a decoder, normalised from a Hugging Face ``config.json``."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    dtype: str | None = None  # the checkpoint's dtype, informative only

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ConfigError(
                f"architecture {self.architecture!r} is not one of llama, qwen2, qwen3"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> DecoderConfig:
        """Normalise a Hugging Face config dict; raises ConfigError naming the offending field."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not known and not archs and raw.get("model_type") in ARCHITECTURES.values():
            known = [raw["model_type"]]
        if not known:
            if not archs:
                raise ConfigError(f"{source}: required field 'architectures' is missing")
            raise ConfigError(
                f"{source}: architecture {archs} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        arch = known[0]
        for name in (*_REQUIRED, "vocab_size"):
            if raw.get(name) is None:
                raise ConfigError(f"{source}: required field {name!r} is missing")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' = {raw['hidden_act']!r}; only silu")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: field 'mlp_bias' = true is not supported")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: field 'use_sliding_window' = true is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ConfigError(
                f"{source}: RoPE scaling {rope_type!r} (field 'rope_scaling') is not supported; "
                "only default RoPE with rope_theta"
            )

        def integer(name: str, default: int | None = None) -> int:
            value = raw.get(name)
            if value is None and default is not None:
                return default
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{source}: field {name!r} must be an integer, got {value!r}")
            return value

        def positive(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{source}: field {name!r} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{source}: field {name!r} must be > 0, got {value!r}")
            return float(value)

        heads = integer("num_attention_heads")
        hidden = integer("hidden_size")
        if heads < 1:
            raise ConfigError(f"{source}: field 'num_attention_heads' must be >= 1, got {heads}")
        head_dim = integer("head_dim", 0) or (hidden // heads if hidden % heads == 0 else 0)
        if not head_dim:
            raise ConfigError(f"{source}: field 'head_dim' is missing and hidden_size % heads != 0")
        bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads", heads),
            head_dim=head_dim,
            rope_theta=positive(
                "rope_theta", rope.get("rope_theta") or raw.get("rope_theta") or 10000.0
            ),
            rms_norm_eps=positive("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            max_position=integer("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bias,  # Qwen2 hard-codes q/k/v bias
            o_bias=False if arch == "qwen2" else bias,
            qk_norm=arch == "qwen3",
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def read_config(model_dir: str | Path) -> DecoderConfig:
    """Read ``config.json`` of a checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"checkpoint {model_dir}: file 'config.json' is missing")
    return DecoderConfig.from_dict(read_json_object(path), source=str(path))


def weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint for ``cfg``, with its shape (tied heads have no lm_head)."""
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, d)
            if cfg.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (i, d)
        shapes[p + "mlp.up_proj.weight"] = (i, d)
        shapes[p + "mlp.down_proj.weight"] = (d, i)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


class Ops(Protocol):
    """Kernels the runner provides for one forward step.

    The model runner supplies them (linear layers, norms, the gated activation, RoPE, paged
    attention).  Parameters carry Hugging Face names, so checkpoints, weight updates and state
    dicts share one naming.
    """

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x @ weight.T + bias`` for ``x`` of shape [rows, in]."""
        ...

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up``."""
        ...

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dimension (see :func:`rms_norm`)."""
        ...

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate-half RoPE of x [T, heads, hd] (see :func:`apply_rope`); may work in place."""
        ...

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store k, v [T, kv_heads, hd] in the cache, attend q [T, heads, hd]; -> [T, heads, hd]."""
        ...


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers computes it: statistics in fp32, scale in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, ops: Ops) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE; x [T, heads, hd], cos/sin [T, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ops: Ops, layer: int) -> Tensor:
        t = x.shape[0]
        q = ops.linear(x, self.q_proj.weight, self.q_proj.bias).view(t, self.num_heads, -1)
        k = ops.linear(x, self.k_proj.weight, self.k_proj.bias).view(t, self.num_kv_heads, -1)
        v = ops.linear(x, self.v_proj.weight, self.v_proj.bias).view(t, self.num_kv_heads, -1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q, ops), self.k_norm.forward(k, ops)
        out = ops.attention(layer, ops.rope(q, cos, sin), ops.rope(k, cos, sin), v)
        return ops.linear(out.reshape(t, -1), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, ops: Ops) -> Tensor:
        gate = ops.linear(x, self.gate_proj.weight, None)
        up = ops.linear(x, self.up_proj.weight, None)
        return ops.linear(ops.silu_mul(gate, up), self.down_proj.weight, None)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ops: Ops, layer: int) -> Tensor:
        x = self.input_layernorm.forward(h, ops)
        h = h + self.self_attn.forward(x, cos, sin, ops, layer)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h, ops), ops)


class DecoderBody(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderModel(nn.Module):
    """The whole causal LM; ``forward`` returns final-norm hidden states, ``logits`` the head."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        # A tied head reads the embedding directly, so there is one tensor under one name.
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def named_weights(self) -> dict[str, Tensor]:
        """Parameters under their checkpoint names (no duplicates); they alias the live weights."""
        return {name: p for name, p in self.named_parameters()}

    def forward(self, token_ids: Tensor, cos: Tensor, sin: Tensor, ops: Ops) -> Tensor:
        # submodules' forward is called directly: no hooks are used, and nn.Module.__call__
        # costs a few microseconds a call, a measurable share of a small model's decode step
        h = F.embedding(token_ids, self.model.embed_tokens.weight)
        for n, layer in enumerate(self.model.layers):
            h = layer.forward(h, cos, sin, ops, n)
        return self.model.norm.forward(h, ops)

    def logits(self, h: Tensor, ops: Ops) -> Tensor:
        return ops.linear(h, self.lm_head_weight, None)


@contextlib.contextmanager
def _safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)``; a damaged file (truncated, a bad header) is a ConfigError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            f"checkpoint {file.parent}: {file.name} is not a readable safetensors file ({exc}); "
            "save or copy it again (the tiny model: `agentroll model create-tiny DIR`)"
        ) from exc


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from ``model.safetensors`` or the shard index."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{index}: unreadable or lacks 'weight_map': {exc}") from exc
        for file in sorted(set(weight_map.values())):
            if not (root / file).is_file():
                raise ConfigError(
                    f"checkpoint {root}: shard file {file!r} named in {index.name} is missing"
                )
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise ConfigError(
            f"checkpoint {root}: file 'model.safetensors' (or 'model.safetensors.index.json') "
            "is missing; only safetensors checkpoints are loaded"
        )
    with _safetensors(single) as f:
        names: list[str] = f.keys()
    return dict.fromkeys(names, single)


def read_tensors(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor of a safetensors checkpoint directory (cast to ``dtype`` when given)."""
    out: dict[str, Tensor] = {}
    files = checkpoint_files(model_dir)
    for file in sorted(set(files.values())):
        with _safetensors(file) as f:
            for name in [n for n, where in files.items() if where == file]:
                if not name.endswith(_IGNORED_SUFFIXES):
                    tensor = f.get_tensor(name)
                    out[name] = tensor if dtype is None else tensor.to(dtype)
    return out


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderModel:
    """Build the model of ``config.json`` and fill it from the directory's safetensors files.

    Raises ConfigError naming the missing file, field or tensor, or the tensor whose shape is wrong.
    """
    cfg = read_config(model_dir)
    files = checkpoint_files(model_dir)
    shapes = weight_shapes(cfg)
    missing = [name for name in shapes if name not in files]
    if missing:
        where = sorted({p.name for p in files.values()}) or ["model.safetensors"]
        raise ConfigError(
            f"checkpoint {model_dir}: tensor {missing[0]!r} is missing from {', '.join(where)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = [
        n
        for n in files
        if n not in shapes
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if extra:
        raise ConfigError(
            f"checkpoint {model_dir}: tensors not described by config.json "
            f"({cfg.architecture}): {', '.join(sorted(extra)[:5])}"
        )
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(files[name], []).append(name)
    # shapes from the files' headers first: a config.json that does not match them is an
    # error before its model is allocated (a wrong vocab_size could ask for terabytes)
    for file, names in sorted(by_file.items()):
        with _safetensors(file) as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != shapes[name]:
                    raise ConfigError(
                        f"checkpoint {model_dir}: tensor {name!r} in {file.name} has shape "
                        f"{shape}, config.json implies {shapes[name]}"
                    )
    with torch.device("meta"):
        model = DecoderModel(cfg).to(dtype)
    model.to_empty(device=device)
    params = model.named_weights()
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with _safetensors(file) as f:
                for name in names:
                    params[name].copy_(f.get_tensor(name).to(dtype))
    return model.eval()
