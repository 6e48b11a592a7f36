import math
from pathlib import Path

import pytest

from agentroll.model.sizes import sizes_for_checkpoint, sizes_for_params


def test_70b_with_adam_is_about_a_terabyte_vs_140_gb() -> None:
    s = sizes_for_params(70_000_000_000)
    assert 0.95e12 < s.training_state_bytes < 1.05e12
    assert s.inference_export_bytes == 140_000_000_000
    assert "training_state=980.0GB inference_export=140.0GB" in s.line()


def test_checkpoint_sizes_count_every_tensor(tiny_model: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert sizes_for_checkpoint(tiny_model).params == params
    with pytest.raises(ValueError, match="serving dtype"):
        sizes_for_params(10, "float7")
