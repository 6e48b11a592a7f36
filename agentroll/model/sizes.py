"""Sizes of the two artifacts a training run produces: the training state (what resuming
training needs) and the inference export (what replicas load).  Pure arithmetic.

Invariants: the training state of mixed-precision Adam is bf16 weights + fp32 master weights
+ two fp32 Adam moments per parameter (14 bytes) plus scheduler and RNG state (a few KB);
the inference export is the weights alone in the serving dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from agentroll.engine.models.decoder import read_config, weight_shapes

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "fp8": 1}
# bf16 weights (2) + fp32 master copy (4) + Adam exp_avg (4) + exp_avg_sq (4)
TRAIN_BYTES_PER_PARAM = 14
TRAIN_EXTRA_BYTES = 64 * 1024  # scheduler, RNG states, step counters


@dataclass(frozen=True)
class ArtifactSizes:
    params: int
    training_state_bytes: int
    inference_export_bytes: int
    serving_dtype: str

    def line(self) -> str:
        return (
            f"params={self.params} training_state={_human(self.training_state_bytes)} "
            f"inference_export={_human(self.inference_export_bytes)} serving_dtype={self.serving_dtype} "
            f"ratio={self.training_state_bytes / max(self.inference_export_bytes, 1):.1f}"
        )


def _human(n: int) -> str:
    """Decimal units (GB = 10**9 bytes), as model sizes are usually quoted."""
    if n < 1000:
        return f"{n}B"
    exp = min(int(math.log10(n) // 3), 4)
    return f"{n / 1000**exp:.1f}{'BKMGT'[exp]}B"


def sizes_for_params(params: int, serving_dtype: str = "bfloat16") -> ArtifactSizes:
    """Artifact sizes of a model with ``params`` parameters."""
    if params < 1:
        raise ValueError("params must be >= 1")
    try:
        per = _DTYPE_BYTES[serving_dtype]
    except KeyError:
        raise ValueError(
            f"serving dtype {serving_dtype!r} unknown; use one of {sorted(_DTYPE_BYTES)}"
        ) from None
    return ArtifactSizes(
        params=params,
        training_state_bytes=params * TRAIN_BYTES_PER_PARAM + TRAIN_EXTRA_BYTES,
        inference_export_bytes=params * per,
        serving_dtype=serving_dtype,
    )


def sizes_for_checkpoint(model_dir: str | Path, serving_dtype: str = "bfloat16") -> ArtifactSizes:
    """Artifact sizes of the model described by ``model_dir/config.json``."""
    shapes = weight_shapes(read_config(model_dir))
    return sizes_for_params(sum(math.prod(s) for s in shapes.values()), serving_dtype)
