"""Layout conversion: bounded buckets, names, casts and fusions on plain tensors, and the
FSDP2 round trip over gloo in two processes (``layout_roundtrip``)."""

from pathlib import Path

import pytest
import torch

from agentroll.errors import ConfigError
from agentroll.validate.layout import check_layout_roundtrip
from agentroll.weights.layout import Fuse, ServingLayout, convert, full_update
from agentroll.weights.update import as_uint


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("_orig_mod.embed.weight", torch.randn(64, 16, generator=g)),
        ("module.q.weight", torch.randn(16, 16, generator=g)),
        ("module.k.weight", torch.randn(8, 16, generator=g)),
        ("rope.inv_freq", torch.randn(8, generator=g)),
        ("head.weight", torch.randn(64, 16, generator=g)),
    ]


def test_buckets_are_bounded_and_cast_like_the_exporter() -> None:
    layout = ServingLayout(
        dtype="bfloat16", skip=("rope.inv_freq",), rename={"head.weight": "lm_head.weight"}
    )
    buckets = list(convert(_named(), layout, bucket_bytes=1024))
    got = {n: t for b in buckets for n, t in b.items()}
    assert list(got) == ["embed.weight", "q.weight", "k.weight", "lm_head.weight"]
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    for b in buckets:  # a tensor over the bound is a bucket of its own
        size = sum(t.numel() * t.element_size() for t in b.values())
        assert size <= 1024 or len(b) == 1
    assert [list(b) for b in buckets] == [
        ["embed.weight"],
        ["q.weight", "k.weight"],
        ["lm_head.weight"],
    ]
    src = dict(_named())
    assert (as_uint(got["q.weight"]) == as_uint(src["module.q.weight"].to(torch.bfloat16))).all()


def test_fusion_concatenates_once_all_sources_are_in() -> None:
    layout = ServingLayout(fuse=(Fuse(target="qk.weight", sources=("q.weight", "k.weight")),))
    got = {n: t for b in convert(_named(), layout) for n, t in b.items()}
    src = dict(_named())
    assert "q.weight" not in got
    assert torch.equal(
        got["qk.weight"], torch.cat([src["module.q.weight"], src["module.k.weight"]])
    )
    update = full_update(convert(_named(), layout), version=3)
    assert update.kind == "full" and {t.name for t in update.tensors} == set(got)


def test_bad_layouts_say_what_is_wrong() -> None:
    missing = ServingLayout(fuse=(Fuse(target="qv.weight", sources=("q.weight", "v.weight")),))
    with pytest.raises(ConfigError, match="missing sources"):
        list(convert(_named(), missing))
    twice = ServingLayout(rename={"q.weight": "k.weight"})
    with pytest.raises(ConfigError, match="two trainer tensors"):
        list(convert(_named(), twice))
    with pytest.raises(ConfigError, match="serving dtype"):
        ServingLayout(dtype="float8")
    with pytest.raises(ConfigError, match="two or more"):
        ServingLayout(fuse=(Fuse(target="x", sources=("q.weight",)),))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp2_shards_convert_bit_exactly(tiny_model: Path, dtype: str) -> None:
    r = check_layout_roundtrip(tiny_model, dtype=dtype)
    assert r.passed, r.line()
    assert r.figures["sharded_tensors"] == r.figures["tensors"] and r.figures["buckets"] > 1
