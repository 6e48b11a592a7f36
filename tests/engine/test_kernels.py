"""The C++ CPU kernels: agreement with the torch reference, per-row invariance, bad input, and
the loader (cache, off switch, a machine without a compiler)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from agentroll.engine import kernels
from agentroll.engine.models.decoder import apply_rope, rms_norm

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    module = kernels.get()
    if module is None:
        pytest.skip(f"the CPU kernels could not be built: {kernels._state.get('error')}")
    return module


def test_rms_norm_silu_rope_match_torch(ext: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 128), (33, 96), (5, 4, 32), (7, 1000)]:
        x = torch.randn(*shape, generator=gen) * 3
        w = torch.randn(shape[-1], generator=gen)
        assert torch.allclose(ext.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=2e-6, rtol=1e-5)
    gate, up = torch.randn(2, 9, 130, generator=gen) * 4
    assert torch.allclose(ext.silu_mul(gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)
    x = torch.randn(6, 3, 64, generator=gen)
    cos, sin = torch.randn(2, 6, 64, generator=gen)
    want = apply_rope(x, cos[:, None], sin[:, None])
    got = ext.rope_(x.clone(), cos, sin)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def _to_cache(k: torch.Tensor, v: torch.Tensor, block_size: int):  # type: ignore[no-untyped-def]
    """Slot rows [slots, kv_heads, dim] in the kernels' layout: K [blocks, kv_heads, dim,
    block_size], V [blocks, kv_heads, block_size, dim]."""
    kb = k.view(-1, block_size, *k.shape[1:])
    vb = v.view(-1, block_size, *v.shape[1:])
    return kb.permute(0, 2, 3, 1).contiguous(), vb.permute(0, 2, 1, 3).contiguous()


def _to_rows(kc: torch.Tensor, vc: torch.Tensor):  # type: ignore[no-untyped-def]
    """The kernels' caches back as slot rows [slots, kv_heads, dim]."""
    kvh, dim = kc.shape[1], kc.shape[2]
    k = kc.permute(0, 3, 1, 2).reshape(-1, kvh, dim)
    return k, vc.permute(0, 2, 1, 3).reshape(-1, kvh, dim)


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, kv_heads, dim)
    k, v = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    return _to_cache(k, v, block_size)


def _reference(q, kc, vc, tables, rows, lens, block_size):  # type: ignore[no-untyped-def]
    kc, vc = _to_rows(kc, vc)
    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        table = tables[int(rows[i])]
        slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(n)]
        idx = torch.tensor(slots)
        k = kc.index_select(0, idx).transpose(0, 1)[None]  # [1, kvh, n, d]
        v = vc.index_select(0, idx).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i : i + 1, :, None], k, v, enable_gqa=True)
        out.append(o[:, :, 0])
    return torch.cat(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [
        (2, 1, 64, 16),
        (4, 2, 128, 8),
        (4, 2, 32, 4),
        (3, 3, 16, 5),
        (15, 5, 64, 16),  # groups of 3 (smollm2-360m)
        (7, 1, 64, 16),  # a group in two passes, 4 heads then 3
        (5, 1, 128, 8),  # passes of 2, 2 and 1 at d = 128
    ],
)
def test_paged_attention_matches_gather_and_sdpa(
    ext: ModuleType, heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    num_blocks = 40
    kc, vc = _cache(num_blocks, block_size, kv_heads, dim, seed=heads)
    rng = random.Random(heads)
    # shuffled, partly shared block tables; some rows are the causal rows of one prefill
    tables = torch.tensor([rng.sample(range(num_blocks), 8) for _ in range(4)])
    tables[1, :3] = tables[0, :3]  # a shared prefix
    rows = torch.tensor([0, 1, 2, 3, 3, 3, 3])
    lens = torch.tensor([1, 8 * block_size, 3 * block_size + 1, 10, 11, 12, 13])
    q = torch.randn(len(rows), heads, dim, generator=torch.Generator().manual_seed(9))
    got = ext.paged_attention(q, kc, vc, tables, rows, lens, dim**-0.5)
    want = _reference(q, kc, vc, tables, rows, lens, block_size)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


def test_every_kernel_is_per_row_invariant(ext: ModuleType) -> None:
    """A row's result is bit-identical alone and among any others (the batch-invariant mode
    depends on it), and a prefill row equals the same position computed as a decode."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 130, generator=gen), torch.randn(130, generator=gen)
    full = ext.rms_norm(x, w, 1e-6)
    silu = ext.silu_mul(x, x)
    for r in (0, 17, 36):
        assert torch.equal(ext.rms_norm(x[r : r + 1].clone(), w, 1e-6), full[r : r + 1])
        assert torch.equal(
            ext.silu_mul(x[r : r + 1].clone(), x[r : r + 1].clone()), silu[r : r + 1]
        )
    kc, vc = _cache(32, 16, 1, 64, seed=2)
    tables = torch.arange(32).view(2, 16)
    q = torch.randn(40, 2, 64, generator=gen)
    rows, lens = torch.zeros(40, dtype=torch.long), torch.arange(100, 140)
    prefill = ext.paged_attention(q, kc, vc, tables, rows, lens, 0.125)
    for r in (0, 21, 39):
        one = ext.paged_attention(
            q[r : r + 1].clone(), kc, vc, tables[:1].clone(), rows[:1], lens[r : r + 1], 0.125
        )
        assert torch.equal(one, prefill[r : r + 1])


def test_paged_attention_reads_a_rows_heads_together_or_apart_alike(ext: ModuleType) -> None:
    """With many rows each thread takes a row's kv heads together (a block read once), with
    few it takes one kv head at a time; a row's result is bit-identical either way."""
    kc, vc = _cache(64, 16, 5, 64, seed=4)
    gen = torch.Generator().manual_seed(5)
    tables = torch.randperm(64, generator=gen).view(8, 8)
    rows = torch.arange(24) % 8
    lens = torch.randint(1, 8 * 16 + 1, (24,), generator=gen)
    q = torch.randn(24, 15, 64, generator=gen)
    together = ext.paged_attention(q, kc, vc, tables, rows, lens, 0.125)
    want = _reference(q, kc, vc, tables, rows, lens, 16)
    assert torch.allclose(together, want, atol=2e-6, rtol=1e-5)
    for r in (0, 11, 23):
        apart = ext.paged_attention(
            q[r : r + 1].clone(), kc, vc, tables, rows[r : r + 1], lens[r : r + 1], 0.125
        )
        assert torch.equal(apart, together[r : r + 1])


def test_bad_input_raises_and_names_it(ext: ModuleType) -> None:
    kc, vc = _cache(4, 4, 1, 8, seed=3)
    q = torch.randn(1, 1, 8)
    ok = (torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([5]))
    ext.paged_attention(q, kc, vc, *ok, 1.0)
    with pytest.raises(RuntimeError, match="block id 9"):
        ext.paged_attention(q, kc, vc, torch.tensor([[0, 9]]), ok[1], ok[2], 1.0)
    with pytest.raises(RuntimeError, match="lens"):
        ext.paged_attention(q, kc, vc, ok[0], ok[1], torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="lens"):
        ext.paged_attention(q, kc, vc, ok[0], ok[1], torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="not a table row"):
        ext.paged_attention(q, kc, vc, ok[0], torch.tensor([1]), ok[2], 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ext.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.silu_mul(torch.ones(4, 4).t(), torch.ones(4, 4))
    with pytest.raises(RuntimeError, match="weight must be"):
        ext.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_off_switch_and_a_machine_without_a_compiler(tmp_path: Path) -> None:
    probe = (
        "from agentroll.engine import kernels; from agentroll.engine.model_runner import ModelRunner;"
        "from agentroll.model.tiny import ensure_tiny_model;"
        "r = ModelRunner(ensure_tiny_model(), num_blocks=4); print('kernels', r.kernels is not None)"
    )
    off = _python(probe, AGENTROLL_CPU_KERNELS="0")
    assert off.returncode == 0, off.stderr
    assert "kernels False" in off.stdout and "warning" not in off.stderr
    # an empty cache and no working compiler: a warning that says what to do, and torch ops
    broken = _python(probe, AGENTROLL_KERNEL_DIR=str(tmp_path), CXX="/bin/false")
    assert broken.returncode == 0, broken.stderr
    assert "kernels False" in broken.stdout
    assert "could not be built" in broken.stderr and "apt-get install g++" in broken.stderr
    assert not list(tmp_path.glob("*/*.so"))


@pytest.mark.slow
def test_builds_from_scratch_into_an_empty_cache(tmp_path: Path) -> None:
    code = (
        "from agentroll.engine import kernels; import torch;"
        "m = kernels.build(); x = torch.randn(3, 8);"
        "print('ok', torch.allclose(m.rms_norm(x, torch.ones(8), 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))"
    )
    done = _python(code, AGENTROLL_KERNEL_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "ok True" in done.stdout and "compiling" in done.stderr
    assert len(list(tmp_path.glob("*/*.so"))) == 1
    again = _python(code, AGENTROLL_KERNEL_DIR=str(tmp_path))  # cached: no second build
    assert again.returncode == 0 and "ok True" in again.stdout and "compiling" not in again.stderr


def _sample(
    ext: ModuleType, logits: torch.Tensor, temp: float, top_k: int, top_p: float, u: list[float]
):  # type: ignore[no-untyped-def]
    n = logits.shape[0]
    return ext.sample(
        logits,
        torch.full((n,), temp),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        torch.tensor(u, dtype=torch.float32),
    )


@pytest.mark.parametrize(
    ("temp", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (1.0, 0, 0.8), (0.9, 50, 0.9)],
)
def test_sample_draws_from_the_filtered_distribution(
    ext: ModuleType, temp: float, top_k: int, top_p: float
) -> None:
    """Each token is where u falls in the filtered distribution's mass (checked in float64 up
    to rounding), its logprob is that distribution's, and filtered-out tokens never come."""
    from agentroll.backends.base import SamplingParams
    from agentroll.engine.sampler import filtered_logprobs

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 300, generator=gen) * 2
    u = torch.rand(64, generator=gen).tolist()
    tokens, logprobs = _sample(ext, logits, temp, top_k, top_p, u)
    ref = filtered_logprobs(logits, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
    for r in range(64):
        t = int(tokens[r])
        assert torch.isfinite(ref[r, t]), f"row {r}: token {t} was filtered out"
        assert abs(float(logprobs[r]) - float(ref[r, t])) < 2e-5
        probs = ref[r].double().exp()
        before, upto = float(probs[:t].sum()), float(probs[: t + 1].sum())
        assert before - 1e-5 <= u[r] <= upto + 1e-5, (r, t, before, u[r], upto)


def test_sample_frequencies_follow_the_probabilities(ext: ModuleType) -> None:
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, 0.0]]).repeat(4000, 1)
    u = [(i + 0.5) / 4000 for i in range(4000)]  # an even grid: counts are the masses
    tokens, _ = _sample(ext, logits, 1.0, 0, 1.0, u)
    counts = torch.bincount(tokens, minlength=5).double() / 4000
    assert torch.allclose(counts, torch.softmax(logits[0].double(), -1), atol=1e-3)


def test_greedy_log_softmax_and_per_row_invariance(ext: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 1000, generator=gen) * 3
    tokens, logprobs = _sample(ext, logits, 0.0, 0, 1.0, [0.5] * 20)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    lsm = ext.log_softmax(logits)
    assert torch.allclose(lsm, torch.log_softmax(logits, -1), atol=1e-5)
    # what sample reports at temperature 1 is exactly what log_softmax gives (rescoring)
    u = torch.rand(20, generator=gen).tolist()
    tokens, logprobs = _sample(ext, logits, 1.0, 0, 1.0, u)
    assert torch.equal(logprobs, lsm.gather(1, tokens[:, None])[:, 0])
    for r in (0, 7, 19):
        t1, l1 = _sample(ext, logits[r : r + 1].clone(), 1.0, 0, 1.0, u[r : r + 1])
        assert int(t1[0]) == int(tokens[r]) and float(l1[0]) == float(logprobs[r])
    with pytest.raises(RuntimeError, match="top_k must be"):
        ext.sample(
            logits, torch.ones(20), torch.zeros(3, dtype=torch.long), torch.ones(20), torch.ones(20)
        )


def test_store_kv_writes_the_slots_and_refuses_bad_ones(ext: ModuleType) -> None:
    from agentroll.engine.model_runner import ModelRunner

    kc, vc = _to_cache(*torch.zeros(2, 12, 2, 4), block_size=4)
    k, v = torch.randn(2, 3, 2, 4)
    slots = torch.tensor([7, 0, 11])
    want_k, want_v = _to_rows(kc, vc)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    torch_k, torch_v = kc.clone(), vc.clone()  # the torch ops' store, on the same layout
    ModelRunner.store_kv(torch_k, torch_v, slots, k, v)
    ext.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, torch_k) and torch.equal(vc, torch_v)
    got_k, got_v = _to_rows(kc, vc)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(RuntimeError, match="slot 12"):
        ext.store_kv(k, v, kc, vc, torch.tensor([1, 2, 12]))
    with pytest.raises(RuntimeError, match="the caches must be"):
        ext.store_kv(k, v, *_to_rows(kc, vc), slots)
    assert torch.equal(kc, torch_k)  # refused before any write


def test_uniform_is_the_samplers_own_draw(ext: ModuleType) -> None:
    import numpy as np

    from agentroll.engine.sampler import uniform

    seeds = [0, 1, 5, -3, 2**63 + 11, 2**70 + 5, 123456789]
    steps = [0, 1, 7, 0, 1000, 3, 2**31]
    bits = np.array([s & (2**64 - 1) for s in seeds], dtype=np.uint64).view(np.int64)
    got = ext.uniform(torch.from_numpy(bits), torch.tensor(steps))
    want = np.array([uniform(s, t) for s, t in zip(seeds, steps, strict=True)], dtype=np.float32)
    assert got.numpy().tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 128, 64), (7, 96, 160), (32, 128, 1024), (70, 600, 300), (3, 1100, 17)]
)
def test_linear_matches_torch(ext: ModuleType, m: int, k: int, n: int) -> None:
    """The blocked products (several row, column and depth blocks in the larger shapes)."""
    gen = torch.Generator().manual_seed(m * n)
    x, wt, bias = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen), torch.randn(n)
    assert torch.allclose(ext.linear(x, wt, None, 0), x @ wt, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ext.linear(x, wt, bias, 0), x @ wt + bias, atol=1e-4, rtol=1e-4)


def test_linear_rows_do_not_depend_on_the_others_with_a_tile(ext: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    x, wt = torch.randn(64, 200, generator=gen), torch.randn(200, 300, generator=gen)
    alone = torch.cat(
        [ext.linear(F.pad(x[i : i + 1], (0, 0, 0, 31)), wt, None, 32)[:1] for i in range(64)]
    )
    assert torch.equal(ext.linear(x, wt, None, 32), alone)
    with pytest.raises(RuntimeError, match="multiple of tile"):
        ext.linear(x[:5], wt, None, 32)
    with pytest.raises(RuntimeError, match=r"x must be \[m, k\]"):
        ext.linear(x, wt.t().contiguous(), None, 0)


def test_decoder_forward_refuses_bad_indexes_before_writing(ext: ModuleType) -> None:
    """Only the refusals: its results are checked against transformers through the model
    runner (tests/engine/test_model_runner.py), whose decode steps and batch-invariant
    steps run on it."""
    from agentroll.engine.model_runner import ForwardItem, ModelRunner
    from agentroll.model.tiny import ensure_tiny_model

    runner = ModelRunner(ensure_tiny_model(), num_blocks=8, block_size=4)
    plan = runner._plan([ForwardItem([1], 0, [0]), ForwardItem([2], 3, [1])])
    ok = runner._forward_fused(plan, runner._fused_weights()).last_logits
    assert set(ok) == {0, 1} and ok[0].shape == (runner.config.vocab_size,)
    runner.k_cache[0].zero_()
    weights = runner._fused_weights()
    one = torch.tensor([0])

    def call(tokens: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> None:
        cfg = runner.config
        ext.decoder_forward(
            tokens,
            one,
            slots,
            torch.tensor([[0]]),
            one,
            lens,
            one,
            runner._cos,
            runner._sin,
            weights,
            runner.k_cache,
            runner.v_cache,
            cfg.num_heads,
            cfg.num_kv_heads,
            4,
            cfg.rms_norm_eps,
            runner.scale,
            0,
            no_timings,
        )

    no_timings = torch.empty(0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="token id 5000"):
        call(torch.tensor([5000]), one, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="slot 99"):
        call(one, torch.tensor([99]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="lens"):
        call(one, one, torch.tensor([9]))
    with pytest.raises(RuntimeError, match=r"expected .* weights"):
        ext.decoder_forward(
            one,
            one,
            one,
            torch.tensor([[0]]),
            one,
            one,
            one,
            runner._cos,
            runner._sin,
            weights[:-1],
            runner.k_cache,
            runner.v_cache,
            2,
            1,
            4,
            1e-6,
            0.125,
            0,
            no_timings,
        )
    assert not runner.k_cache[0].any()


def test_decoder_forward_times_its_regions_only_when_asked(ext: ModuleType) -> None:
    from agentroll.engine.model_runner import ForwardItem, ModelRunner
    from agentroll.model.tiny import ensure_tiny_model

    runner = ModelRunner(ensure_tiny_model(), num_blocks=8, block_size=4)
    plan = runner._plan([ForwardItem([1, 2, 3], 0, [0]), ForwardItem([2], 3, [1])])
    plain = runner._forward_fused(plan, runner._fused_weights()).last_logits
    regions = list(ext.decoder_regions())
    assert regions[0] == "setup" and {"qkv", "attention", "gate_up", "lm_head"} <= set(regions)
    runner.step_timings = torch.zeros(len(regions), dtype=torch.float64)
    timed = runner._forward_fused(plan, runner._fused_weights()).last_logits
    assert all(torch.equal(plain[i], timed[i]) for i in plain)  # the clock changes nothing
    assert (runner.step_timings > 0).all() and float(runner.step_timings.sum()) < 10.0
    before = runner.step_timings.clone()
    runner._forward_fused(plan, runner._fused_weights())
    assert (runner.step_timings > before).all()  # added to, not overwritten
    runner.step_timings = torch.zeros(len(regions))  # float32: refused before any write
    with pytest.raises(RuntimeError, match="timings must be empty or"):
        runner._forward_fused(plan, runner._fused_weights())


def test_linear_takes_a_column_slice_of_a_fused_weight(ext: ModuleType) -> None:
    gen = torch.Generator().manual_seed(2)
    x, fused = torch.randn(9, 64, generator=gen), torch.randn(64, 96, generator=gen)
    for cols in (slice(0, 32), slice(32, 48), slice(48, 96)):
        assert torch.allclose(ext.linear(x, fused[:, cols], None, 0), x @ fused[:, cols], atol=1e-4)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ext.linear(x, fused.t().contiguous().t()[:, :10], None, 0)


def test_packed_products_match_torch_on_any_width_and_slice(ext: ModuleType) -> None:
    from agentroll.engine.model_runner import PACK_COLS, _packed_views

    gen = torch.Generator().manual_seed(3)
    for rows, k, n in ((1, 64, 96), (9, 100, 70), (70, 33, 130)):  # ragged last panels
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        for packed in (ext.pack_weight(w.t()), ext.pack_weight(w.t().contiguous())):
            assert packed.shape == (k * n,)
            got = ext.linear_packed(x, packed, n, bias, 0)
            assert torch.allclose(got, x @ w.t() + bias, atol=1e-4)
    # parts side by side: a part of whole panels is a slice of the fused weight, others a copy
    x = torch.randn(5, 40, generator=gen)
    for sizes, slices in (((64, 32, 20), (0, 64, 96)), ((20, 44, 32), (None, None, 64))):
        parts = [torch.randn(n, 40, generator=gen) for n in sizes]
        fused = ext.pack_weight(torch.cat(parts).t())
        views = _packed_views(fused, parts, ext.pack_weight)
        for part, col in zip(parts, slices, strict=True):
            packed, n = views[id(part)]
            assert n == part.shape[0]
            assert torch.allclose(ext.linear_packed(x, packed, n, None, 0), x @ part.t(), atol=1e-4)
            if col is None:
                assert packed.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
            else:
                assert packed.data_ptr() == fused.data_ptr() + col * 40 * 4
    with pytest.raises(RuntimeError, match="packed"):
        ext.linear_packed(x, fused, 7, None, 0)  # the wrong number of columns
    with pytest.raises(RuntimeError, match="multiple of tile"):
        ext.linear_packed(x, ext.pack_weight(torch.randn(40, PACK_COLS)), PACK_COLS, None, 4)


def test_packed_products_of_a_few_rows_stream_each_panel_once(ext: ModuleType) -> None:
    """Up to 8 rows run one loop over each full panel (its own kernel on AVX-512): every
    row count from 1 to 8 and a 9th (the blocked product) match a float64 product, depths
    past one brgemm block included, a ragged last panel too; a row's bits do not depend on
    how many other rows (up to 8) share the call."""
    gen = torch.Generator().manual_seed(11)
    for k, n in ((960, 160), (4100, 64), (37, 70)):
        w = torch.randn(n, k, generator=gen)
        packed = ext.pack_weight(w.t())
        x = torch.randn(9, k, generator=gen)
        want = (x.double() @ w.double().t()).float()
        outs = {m: ext.linear_packed(x[:m].clone(), packed, n, None, 0) for m in range(1, 10)}
        for m, got in outs.items():
            assert torch.allclose(got, want[:m], atol=1e-3, rtol=1e-4), (k, n, m)
        for m in range(1, 8):
            assert torch.equal(outs[m], outs[8][:m]), (k, n, m)


def test_huge_zeros_are_zeroed_aligned_and_outlive_their_first_tensor(ext: ModuleType) -> None:
    """``huge_zeros``: a zeroed, writable tensor of the shape and dtype asked for; from 2 MB
    on a mapping aligned to 2 MB (where pages of that size can back it), below that an
    ordinary allocation; a view keeps the mapping alive after the tensor that made it goes,
    and packed weights come from it."""
    for shape, dtype in (
        ((3, 5), torch.float32),
        ((2, 4, 1 << 18), torch.float32),
        ((1 << 21,), torch.bfloat16),
    ):
        t = ext.huge_zeros(list(shape), dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        big = t.numel() * t.element_size() >= 2 << 20
        if big and sys.platform.startswith("linux"):
            assert t.data_ptr() % (2 << 20) == 0
        t.view(-1)[-1] = 7
        tail = t.view(-1)[-2:]
        del t
        assert tail.tolist() == [0, 7]
    w = torch.randn(640, 1024)
    packed = ext.pack_weight(w.t())
    if sys.platform.startswith("linux"):
        assert packed.data_ptr() % (2 << 20) == 0
    assert torch.allclose(ext.linear_packed(w[:3], packed, 640, None, 0), w[:3] @ w.t(), atol=1e-3)
    with pytest.raises(RuntimeError, match="negative"):
        ext.huge_zeros([2, -1], torch.float32)


def test_packed_copies_follow_the_memory_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentroll.engine.model_runner import ModelRunner, packed_max_bytes
    from agentroll.errors import ConfigError
    from agentroll.model.tiny import ensure_tiny_model

    monkeypatch.setenv("AGENTROLL_PACKED_MAX_MB", "0")
    assert packed_max_bytes() == 0
    assert not ModelRunner(ensure_tiny_model(), num_blocks=8, block_size=4).packed
    monkeypatch.setenv("AGENTROLL_PACKED_MAX_MB", "lots")
    with pytest.raises(ConfigError, match="AGENTROLL_PACKED_MAX_MB"):
        packed_max_bytes()
    monkeypatch.delenv("AGENTROLL_PACKED_MAX_MB")
    assert packed_max_bytes() >= 1 << 28


def test_bf16_products_run_on_every_thread(ext: ModuleType) -> None:
    """The bf16 activations are converted once by the calling thread and read by every
    worker of the product's parallel loop (a per-thread buffer each would be empty)."""
    if not ext.bf16_products():
        pytest.skip("this CPU has no AVX512-BF16 products")
    gen = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (3, 70):
            x, w = torch.randn(rows, 64, generator=gen), torch.randn(640, 64, generator=gen)
            packed = ext.pack_weight_bf16(w.t())
            assert packed.dtype == torch.bfloat16 and packed.shape == (64 * 640,)
            reference = x.bfloat16().float() @ w.bfloat16().float().t()
            for _ in range(3):
                got = ext.linear_packed(x, packed, 640, None, 0)
                assert torch.allclose(got, reference, atol=1e-3)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="k must be even"):
        ext.pack_weight_bf16(torch.randn(3, 32))
