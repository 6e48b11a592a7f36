import math
import time

import msgspec
import numpy as np
import pytest

from agentroll.types import (
    TOKEN_ARRAY_DTYPES,
    Message,
    ToolCall,
    ToolResult,
    Trajectory,
    Turn,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)


def _traj(n: int) -> Trajectory:
    rng = np.random.default_rng(0)
    mask = (rng.random(n) > 0.5).astype(np.uint8)
    lp = np.where(mask == 1, -rng.random(n), np.nan).astype(np.float32)
    pv = np.where(mask == 1, rng.integers(0, 5, n), -1).astype(np.int32)
    return Trajectory(
        id="e1",
        task_id="t1",
        group_id="g1",
        sample_index=3,
        seed=2**62 + 5,
        env_name="calc",
        env_version="1",
        backend="mock",
        status="truncated",
        stop_reason="length",
        error=None,
        reward=0.5,
        rewards={"a": 0.25, "b": 0.25},
        prompt_len=7,
        token_ids=rng.integers(0, 150_000, n).astype(np.int32),
        logprobs=lp,
        loss_mask=mask,
        policy_version=pv,
        kv_version=np.where(mask == 1, pv - 1, -1).astype(np.int32),
        turns=[
            Turn(
                index=0,
                gen_start=7,
                gen_end=20,
                env_end=30,
                finish_reason="tool_calls",
                tool_calls=[ToolCall(id="c", name="calc", arguments={"x": [1, {"y": None}]})],
                tool_results=[ToolResult(call_id="c", name="calc", content="5", error="timeout")],
            )
        ],
        messages=[
            Message(role="user", content="hi ✓"),
            Message(role="tool", content="x", tool_call_id="c"),
        ],
        metrics={"gen_seconds": 0.1},
    )


def _assert_same(a: Trajectory, b: Trajectory) -> None:
    for f in a.__struct_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype
            assert x.tobytes() == y.tobytes(), f  # bit-exact, NaN included
        else:
            assert x == y, f


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_trajectory_round_trip_is_lossless(fmt: str) -> None:
    t = _traj(1000)
    enc, dec = (encode_msgpack, decode_msgpack) if fmt == "msgpack" else (encode_json, decode_json)
    back = dec(enc(t), Trajectory)
    _assert_same(t, back)
    assert math.isnan(back.logprobs[back.loss_mask == 0][0])


def test_32k_trajectory_encodes_as_packed_bytes_fast() -> None:
    t = _traj(32_768)
    start = time.perf_counter()
    for _ in range(20):
        data = encode_msgpack(t)
    per_encode = (time.perf_counter() - start) / 20
    # 5 arrays x 32k x <=4 bytes: packed, not one msgpack item per token
    assert len(data) < 32_768 * 17 + 4096
    assert per_encode < 0.01  # a Python loop over 32k tokens x 5 arrays takes far longer
    _assert_same(t, decode_msgpack(data, Trajectory))


def test_arrays_must_have_equal_length() -> None:
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        Trajectory(id="x", task_id="t", group_id="g", token_ids=[1, 2], logprobs=[0.0])


def test_integer_arrays_take_any_numbers_that_convert_exactly() -> None:
    t = Trajectory(
        id="x",
        task_id="t",
        group_id="g",
        token_ids=np.arange(3, dtype=np.int64),
        loss_mask=np.r_[0, np.ones(2)],  # float64 zeros and ones: what np.ones gives
        logprobs=[math.nan, -1.0, -2.0],
        policy_version=np.r_[-1.0, 3, 3],
        kv_version=[-1, 2, 3],
    )
    assert t.loss_mask.dtype == np.uint8 and t.loss_mask.tolist() == [0, 1, 1]
    assert t.policy_version.tolist() == [-1, 3, 3]


@pytest.mark.parametrize(
    "field, values",
    [
        ("token_ids", np.array([1.5, 2.0, 3.0])),  # a fraction
        ("token_ids", np.array([2**40, 1, 2])),  # out of int32: wrapped around before
        ("token_ids", [2**40, 1, 2]),
        ("loss_mask", np.array([-1, 0, 1])),  # out of uint8
        ("policy_version", np.array([np.nan, 0.0, 0.0])),  # NaN: INT_MIN before
        ("kv_version", np.array(["a", "b", "c"])),
    ],
)
def test_integer_arrays_refuse_conversions_that_change_values(field: str, values: object) -> None:
    arrays: dict[str, object] = {name: np.zeros(3) for name in TOKEN_ARRAY_DTYPES}
    arrays[field] = values
    with pytest.raises(ValueError, match=f"Trajectory.{field}"):
        Trajectory(id="x", task_id="t", group_id="g", **arrays)  # type: ignore[arg-type]


def test_bad_wire_input_is_a_validation_error() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_json(b'{"id": 1}', Trajectory)
    with pytest.raises((msgspec.ValidationError, ValueError)):
        decode_json(b'{"id":"a","task_id":"t","group_id":"g","token_ids":[1,2]}', Trajectory)


def test_min_policy_version_ignores_prompt_tokens() -> None:
    t = _traj(100)
    assert t.min_policy_version() == int(t.policy_version[t.loss_mask == 1].min())


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_strided_array_views_round_trip_as_their_values(fmt: str) -> None:
    base = _traj(400)
    t = msgspec.structs.replace(
        base,
        token_ids=np.arange(800, dtype=np.int32)[::2],
        logprobs=base.logprobs.reshape(200, 2)[:, 0].repeat(2),
        policy_version=np.ascontiguousarray(base.policy_version[::-1])[::-1],
    )
    assert not t.token_ids.flags.c_contiguous and not t.policy_version.flags.c_contiguous
    enc, dec = (encode_msgpack, decode_msgpack) if fmt == "msgpack" else (encode_json, decode_json)
    _assert_same(t, dec(enc(t), Trajectory))


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=">i4"),  # big-endian: written little-endian
        np.arange(12, dtype=np.float32)[::3],  # strided view: its values
        np.arange(6, dtype=np.int64).reshape(2, 3).T,  # Fortran order: C-order values
        np.arange(6, dtype=">f8").reshape(2, 3).T,  # both: astype alone kept the layout
        np.array([True, False, True]),
        np.arange(5, dtype=np.float16),
        np.array([-1, 7], dtype="<i4"),
    ],
)
def test_any_array_encodes_as_its_little_endian_c_order_values(arr: np.ndarray) -> None:
    wire = msgspec.msgpack.decode(encode_msgpack({"a": arr}))["a"]
    want = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"))
    assert wire["dtype"] == want.dtype.str
    assert wire["data"] == want.tobytes()
