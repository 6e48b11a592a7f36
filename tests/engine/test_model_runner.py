"""ModelRunner: parity with transformers, paged KV, snapshots, batch invariance, weights, errors."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentroll.engine import kernels
from agentroll.engine.model_runner import ForwardItem, ModelRunner
from agentroll.engine.models import DecoderConfig, read_config
from agentroll.errors import ConfigError
from agentroll.model import create_tiny, random_weights, write_checkpoint

PROMPTS = [
    [998, 445, 198, 337, 400, 78, 756, 999, 198, 998, 435, 198],
    list(range(40, 77)),
    [5, 900, 17, 17, 17, 301, 2, 640, 88, 19, 999, 998, 12, 70, 71, 72, 73, 74, 75, 1000, 3],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def transformers() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield pytest.importorskip("transformers")


def shuffled_table(n: int, seed: int, num_blocks: int = 64) -> list[int]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:n]


def greedy(
    runner: ModelRunner, prompt: list[int], table: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Prefill, then decode ``steps`` tokens one at a time; returns the sequence and the logits
    at each of its positions ([len(seq), vocab])."""
    out = runner.forward([ForwardItem(prompt, 0, table, want_all_logits=True)])
    rows = [out.all_logits[0]]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(rows[-1][-1].argmax()))
        rows.append(
            runner.forward([ForwardItem(seq[-1:], len(seq) - 1, table)]).last_logits[0][None]
        )
    return seq, torch.cat(rows)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_parity(runner: ModelRunner, reference: Any) -> None:
    for i, prompt in enumerate(PROMPTS):
        seq, logits = greedy(runner, prompt, shuffled_table(5, seed=i), steps=16)
        ref = hf_logits(reference, seq)
        diff = (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: max |logprob diff| {diff}"
        assert ref[len(prompt) - 1 : -1].argmax(-1).tolist() == seq[len(prompt) :]


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_reference_parity_with_transformers(
    tiny: Path, transformers: Any, batch_invariant: bool, use_kernels: bool
) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    runner = ModelRunner(
        tiny, num_blocks=64, batch_invariant=batch_invariant, use_kernels=use_kernels
    )
    assert (runner.kernels is not None) == (use_kernels and kernels.get() is not None)
    assert_parity(runner, reference)


def _config(arch: str, **extra: Any) -> dict[str, Any]:
    base = {
        "architectures": [arch],
        "model_type": {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[arch],
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000.0,
        "max_position_embeddings": 512,
    }
    return {**base, **extra}


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
        ("LlamaForCausalLM", {"tie_word_embeddings": False}),
    ],
)
def test_qwen3_and_llama_match_transformers(
    tmp_path: Path, transformers: Any, arch: str, extra: dict[str, Any]
) -> None:
    raw = _config(arch, **extra)
    cfg = DecoderConfig.from_dict(raw)
    write_checkpoint(tmp_path, raw, random_weights(cfg, seed=3))
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM") and not cfg.qkv_bias
    reference = getattr(transformers, arch).from_pretrained(tmp_path).eval()
    for invariant, use_kernels in itertools.product((False, True), (True, False)):
        runner = ModelRunner(
            tmp_path,
            num_blocks=64,
            block_size=4,
            batch_invariant=invariant,
            use_kernels=use_kernels,
        )
        for i, prompt in enumerate(PROMPTS[:2]):
            prompt = [t % 320 for t in prompt]
            seq, logits = greedy(runner, prompt, shuffled_table(20, seed=i), steps=8)
            ref = hf_logits(reference, seq)
            assert (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max() <= 1e-4
            assert ref[len(prompt) - 1 : -1].argmax(-1).tolist() == seq[len(prompt) :]
    state = runner.state_dict()
    assert ("lm_head.weight" in state) != cfg.tie_word_embeddings
    if cfg.tie_word_embeddings:  # the head is the embedding: one tensor, one name
        emb = state["model.embed_tokens.weight"].clone()
        with pytest.raises(ConfigError, match="twice"):
            runner.load_weights({"lm_head.weight": emb, "model.embed_tokens.weight": emb})


def chunked(runner: ModelRunner, prompt: list[int], table: list[int], size: int) -> torch.Tensor:
    rows = []
    for start in range(0, len(prompt), size):
        item = ForwardItem(prompt[start : start + size], start, table, want_all_logits=True)
        rows.append(runner.forward([item]).all_logits[0])
    return torch.cat(rows)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
def test_chunked_prefill_matches_whole_prompt(tiny: Path, use_kernels: bool) -> None:
    prompt, table = PROMPTS[1], shuffled_table(4, seed=7)
    fast = ModelRunner(tiny, num_blocks=64, use_kernels=use_kernels)
    whole = fast.forward([ForwardItem(prompt, 0, table, want_all_logits=True)]).all_logits[0]
    assert (chunked(fast, prompt, table, 5) - whole).abs().max() <= 1e-5
    # Batch-invariant mode: bit-exact whatever the chunking, even one token at a time.
    exact = ModelRunner(tiny, num_blocks=64, batch_invariant=True, use_kernels=use_kernels)
    whole = exact.forward([ForwardItem(prompt, 0, table, want_all_logits=True)]).all_logits[0]
    for size in (1, 5, 16):
        assert torch.equal(chunked(exact, prompt, table, size), whole)


def test_read_write_blocks_round_trip_bit_exact(tiny: Path) -> None:
    runner = ModelRunner(tiny, num_blocks=32, block_size=8)
    prompt, table = PROMPTS[1], [3, 17, 5, 30, 9, 11, 12]
    seq, _ = greedy(runner, prompt, table, steps=4)
    used = table[: -(-(len(seq) - 1) // 8)]
    k, v = runner.read_blocks(used)
    assert k.shape == (2, len(used), 8, 1, 64) and k.device.type == "cpu"
    moved = [0, 1, 2, 4, 6, 7, 8][: len(used)] + [10, 13]  # disjoint from ``table``
    fresh = ModelRunner(tiny, num_blocks=32, block_size=8)  # as if restored in a new process
    for target in (runner, fresh):
        target.write_blocks(moved[: len(used)], k, v)
        k2, v2 = target.read_blocks(moved[: len(used)])
        assert torch.equal(k2, k) and torch.equal(v2, v)
    tail = []
    for r, t in ((runner, table), (runner, moved), (fresh, moved)):
        s = list(seq)
        rows = []
        for _ in range(6):
            logits = r.forward([ForwardItem(s[-1:], len(s) - 1, t)]).last_logits[0]
            rows.append(logits)
            s.append(int(logits.argmax()))
        tail.append(torch.stack(rows))
    assert torch.equal(tail[0], tail[1]) and torch.equal(tail[0], tail[2])
    with pytest.raises(ValueError, match="expected"):
        runner.write_blocks([0], k, v)
    # the snapshot format is position-major whatever the cache's layout: [layer, block,
    # offset in the block, kv head, dim]
    rows = torch.randn(8, 1, 64)
    ModelRunner.store_kv(fresh.k_cache[1], fresh.v_cache[1], torch.arange(24, 32), rows, -rows)
    k, v = fresh.read_blocks([3])
    assert torch.equal(k[1, 0], rows) and torch.equal(v[1, 0], -rows)


@pytest.mark.parametrize(
    ("invariant", "dtype", "use_kernels"),
    [
        (True, torch.float32, True),
        (True, torch.float32, False),
        (True, torch.bfloat16, True),  # no bf16 kernels: the torch path
        (False, torch.float32, True),
        (False, torch.float32, False),
    ],
)
def test_batch_invariant_alone_vs_with_seven_others(
    tiny: Path, invariant: bool, dtype: torch.dtype, use_kernels: bool
) -> None:
    def run(with_others: bool) -> list[torch.Tensor]:
        runner = ModelRunner(
            tiny,
            num_blocks=128,
            batch_invariant=invariant,
            dtype=dtype,
            use_kernels=use_kernels,
        )
        rng = random.Random(1)
        others = [[rng.randrange(1000) for _ in range(rng.randrange(3, 40))] for _ in range(7)]
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(8)]
        target = list(PROMPTS[0])
        seqs = [target, *others] if with_others else [target]
        started = [False] * len(seqs)
        logits = []
        for step in range(10):
            items = []
            for j, s in enumerate(seqs):
                if j and step < j % 3:  # others join late, so the batch shape keeps changing
                    continue
                new = s if not started[j] else s[-1:]
                items.append(
                    ForwardItem(new, len(s) - len(new), tables[j], want_all_logits=not started[j])
                )
                started[j] = True
            out = runner.forward(items)
            for n, item in enumerate(items):
                row = out.last_logits[n]
                seq = seqs[tables.index(list(item.block_table))]
                seq.append(int(row.argmax()))
                if item.block_table == tables[0]:
                    logits.append(out.all_logits.get(n, row))
        return logits

    alone, crowded = run(False), run(True)
    if invariant:
        assert all(torch.equal(a, b) for a, b in zip(alone, crowded, strict=True))
    else:  # padded batched decode rounds differently, but only in the last bits
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(alone, crowded, strict=True))
    assert all(torch.isfinite(a).all() for a in alone)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
def test_bf16_runs_and_roughly_agrees(tiny: Path, use_kernels: bool) -> None:
    from agentroll.engine import kernels

    ext = kernels.get() if use_kernels else None
    fused = ext is not None and ext.bf16_products()  # bf16 products in decoder_forward
    fp32 = ModelRunner(tiny, num_blocks=16)
    bf16 = ModelRunner(tiny, num_blocks=16, dtype=torch.bfloat16, use_kernels=use_kernels)
    assert (bf16.kernels is not None) == fused
    assert bf16.k_cache[0].dtype == torch.bfloat16
    prompt = PROMPTS[2]
    a = fp32.forward([ForwardItem(prompt, 0, [1, 2], want_all_logits=True)]).all_logits[0]
    b = bf16.forward([ForwardItem(prompt, 0, [1, 2], want_all_logits=True)]).all_logits[0]
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7
    diff = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs()
    assert float(diff.max()) < 0.25, float(diff.max())
    # a decode step over the prefilled cache agrees as well
    item = ForwardItem([7], len(prompt), [1, 2])
    da = fp32.forward([item]).last_logits[0]
    db = bf16.forward([item]).last_logits[0]
    assert float((torch.log_softmax(da, -1) - torch.log_softmax(db, -1)).abs().max()) < 0.25


def test_load_weights_changes_outputs_and_is_transactional(tiny: Path) -> None:
    runner = ModelRunner(tiny, num_blocks=16)
    item = ForwardItem(PROMPTS[0], 0, [0])

    def logits() -> torch.Tensor:
        return runner.forward([item]).last_logits[0].clone()

    before = logits()
    weights = {k: v.clone() for k, v in runner.state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"
    runner.load_weights({name: weights[name] * 2})
    changed = logits()
    assert not torch.equal(changed, before)
    bad = {"model.norm.weight": torch.zeros(128), name: torch.zeros(3, 3)}
    with pytest.raises(ConfigError, match=r"down_proj.*shape"):
        runner.load_weights(bad)
    assert torch.equal(logits(), changed)  # nothing of the bad update was applied
    with pytest.raises(ConfigError, match="float32"):
        runner.load_weights({name: weights[name].bfloat16()})
    with pytest.raises(ConfigError, match="unknown to this model"):
        runner.load_weights({"model.layers.9.mlp.up_proj.weight": weights[name]})
    with pytest.raises(ConfigError, match="missing"):
        runner.load_weights({name: weights[name]}, strict=True)
    runner.load_weights(weights, strict=True)
    assert torch.equal(logits(), before)
    runner.load_weights({name: weights[name] * 2})
    runner.load_weights(tiny)  # a checkpoint directory restores the originals too
    assert torch.equal(logits(), before)


def test_state_dict_uses_checkpoint_names(tiny: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(tiny / "model.safetensors")
    state = ModelRunner(tiny, num_blocks=4).state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def test_sharded_checkpoint_loads(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    item = ForwardItem(PROMPTS[0], 0, [0])
    whole = ModelRunner(tiny, num_blocks=4).forward([item]).last_logits[0]
    assert torch.equal(ModelRunner(tmp_path, num_blocks=4).forward([item]).last_logits[0], whole)
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"b\.safetensors"):
        ModelRunner(tmp_path, num_blocks=4)


def test_load_errors_name_the_file_field_or_tensor(tiny: Path, tmp_path: Path) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    cfg = read_config(tiny)
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelRunner(tmp_path, num_blocks=4)
    for field, value, match in [
        ("num_hidden_layers", None, "num_hidden_layers"),
        ("architectures", ["GPT2LMHeadModel"], "GPT2LMHeadModel"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "llama3"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ConfigError, match=match):
            read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"model\.safetensors"):
        ModelRunner(tmp_path, num_blocks=4)
    weights = random_weights(cfg)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    write_checkpoint(tmp_path, raw, weights)
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        ModelRunner(tmp_path, num_blocks=4)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hidden_size", "64", "'hidden_size' must be an integer, got '64'"),
        ("num_attention_heads", 2.5, "'num_attention_heads' must be an integer"),  # was truncated
        ("num_attention_heads", 0, "'num_attention_heads' must be >= 1"),  # ZeroDivisionError
        ("rope_theta", "x", "'rope_theta' must be a number"),  # ValueError
        ("rms_norm_eps", -1, "'rms_norm_eps' must be > 0"),  # was loaded
        ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be > 0"),  # NaN logits
        ("num_key_value_heads", True, "'num_key_value_heads' must be an integer"),
        ("rope_scaling", "linear", "'rope_scaling' must be an object"),  # AttributeError
    ],
)
def test_a_config_field_of_the_wrong_type_or_range_is_named(
    tiny: Path, tmp_path: Path, field: str, value: Any, match: str
) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ConfigError, match=match):
        read_config(tmp_path)


def test_a_config_json_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")  # AttributeError before
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        read_config(tmp_path)


@pytest.mark.parametrize("damage", ["empty", "short", "half", "header"])
def test_a_damaged_safetensors_file_is_named(tiny: Path, tmp_path: Path, damage: str) -> None:
    """safetensors' own SafetensorError ("header too small") named neither file nor remedy."""
    for f in tiny.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = (tiny / "model.safetensors").read_bytes()
    cut = {"empty": b"", "short": data[:7], "half": data[: len(data) // 2]}
    damaged = cut.get(damage, data[:8] + b"{not json" + data[17:])
    (tmp_path / "model.safetensors").write_bytes(damaged)
    with pytest.raises(ConfigError, match=r"model\.safetensors is not a readable safetensors"):
        ModelRunner(tmp_path, num_blocks=4)


def test_a_vocab_size_the_weights_do_not_have_is_refused_before_allocating(
    tiny: Path, tmp_path: Path
) -> None:
    """The shapes are checked against the files' headers first: this config used to ask the
    allocator for 512 TB (a RuntimeError) before any tensor was compared."""
    for f in tiny.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "vocab_size": 10**12}))
    with pytest.raises(ConfigError, match=r"embed_tokens\.weight.*has shape"):
        ModelRunner(tmp_path, num_blocks=4)


def test_bad_items_are_refused_before_any_write(tiny: Path) -> None:
    runner = ModelRunner(tiny, num_blocks=4, block_size=4)
    cases = [
        (ForwardItem([1, 2], 0, [0]), None),
        (ForwardItem([1, 5000], 0, [0]), "token id"),
        (ForwardItem([1] * 5, 0, [0]), "too short"),
        (ForwardItem([1], 0, [7]), "block id"),
        (ForwardItem([], 0, [0]), "new token"),
    ]
    for item, match in cases[1:]:
        with pytest.raises(ValueError, match=match):
            runner.forward([cases[0][0], item])
    with pytest.raises(ValueError, match="same KV slot"):
        runner.forward([ForwardItem([1], 0, [0]), ForwardItem([2], 0, [0])])
    assert all(not c.any() for c in runner.k_cache)
    assert runner.forward([]).last_logits == {}


def test_the_vectorised_decode_plan_equals_the_general_one(tiny: Path) -> None:
    """``_decode_plan`` (decode-only steps, with the kernels) builds the same token ids,
    positions, slots and tables as ``_plan``, and gives way to it for anything else."""
    runner = ModelRunner(tiny, num_blocks=64, block_size=4)
    if not runner.packed:
        pytest.skip("the decode plan is used with the CPU kernels only")
    rng = random.Random(3)
    for _ in range(50):
        items = []
        for _ in range(rng.randint(1, 12)):
            start = rng.randint(0, 30)
            table = rng.sample(range(64), start // 4 + 1 + rng.randint(0, 3))
            items.append(ForwardItem([rng.randrange(1024)], start, table))
        slots = [it.block_table[it.start_pos // 4] * 4 + it.start_pos % 4 for it in items]
        fast = runner._decode_plan(items)
        if len(set(slots)) < len(slots):  # two items on one KV slot: refused either way
            assert fast is None
            continue
        assert fast is not None and fast.all_decodes and fast.tables is not None
        slow = runner._plan(items)
        for name in ("token_ids", "positions", "slots"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        width = fast.tables.shape[1]
        assert width == max(it.start_pos for it in items) // 4 + 1
        for row, it in zip(fast.tables.tolist(), items, strict=True):
            n = min(width, len(it.block_table))
            assert row[:n] == it.block_table[:n] and not any(row[n:])
    prefill = [ForwardItem([1, 2], 0, [0]), ForwardItem([3], 4, [1, 2])]
    assert runner._decode_plan(prefill) is None
    assert runner._decode_plan([ForwardItem([5000], 0, [0])]) is None  # _plan names it
