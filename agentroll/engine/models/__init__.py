"""Model definitions of the built-in engine: one generic decoder (Llama, Qwen2, Qwen3) and its
safetensors loader.  Kernels and the KV cache live in ``agentroll.engine.model_runner``."""

from agentroll.engine.models.decoder import (
    ARCHITECTURES,
    DecoderConfig,
    DecoderModel,
    Ops,
    checkpoint_files,
    load_model,
    read_config,
    read_tensors,
    weight_shapes,
)

__all__ = [
    "ARCHITECTURES",
    "DecoderConfig",
    "DecoderModel",
    "Ops",
    "checkpoint_files",
    "load_model",
    "read_config",
    "read_tensors",
    "weight_shapes",
]
