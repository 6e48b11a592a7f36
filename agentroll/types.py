"""Records that cross process and disk boundaries: msgspec Structs, msgpack and JSON.

Invariants: every record round-trips losslessly through msgpack and JSON (NaN logprobs
included); per-token arrays are numpy arrays of fixed dtype, encoded as packed little-endian
bytes (base64 inside JSON); nothing here is pickled or does I/O; a Trajectory and what it
holds are ``gc=False`` trees, so a record must never be stored inside itself.
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from typing import Any, Literal

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
# cut: a straggler of a group whose reward was decided before it finished (group_cutoff)
Status = Literal["ok", "truncated", "failed", "abandoned", "cut"]
#: what happens to a generation in flight when the weights change under it
ResumePolicy = Literal["keep", "recompute", "restart"]
#: how a fleet moves its replicas to new weights
Strategy = Literal["pause", "rolling", "drain", "background"]

_I4_MAX = int(np.iinfo(np.int32).max)

#: dtype of each per-token array of a Trajectory
TOKEN_ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
    "token_ids": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "loss_mask": np.dtype("u1"),
    "policy_version": np.dtype("<i4"),
    "kv_version": np.dtype("<i4"),
}


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """Per-request sampling parameters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False  # keep going past the end-of-sequence token (benchmarks)

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN too: it made every probability NaN
            raise ValueError("temperature must be a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


class SyncReport(msgspec.Struct, kw_only=True):
    """What one weight update cost the fleet."""

    strategy: str
    version: int
    seconds: float = 0.0
    pause_ms: list[float] = []  # one entry per replica pause (stop -> resume)
    busy_fraction: float = 0.0  # replica-time spent serving requests during the sync
    step_fraction: float = 0.0  # replica-time spent inside engine steps during the sync
    migrated: int = 0
    tokens_recomputed: int = 0
    failed: dict[str, str] = {}  # replica -> why its update failed (it left the rotation)


class SleepReport(msgspec.Struct, kw_only=True):
    """What one ``backend.sleep(level)`` released.  ``freed_bytes`` counts the tensors freed
    (KV cache, and at level 2 the weights and what is derived from them); ``kept_bytes`` the
    host copies of the KV of requests that continue from it (``keep``)."""

    level: int
    version: int
    freed_bytes: int = 0
    kv_bytes: int = 0
    weight_bytes: int = 0
    kept_bytes: int = 0
    parked: int = 0  # requests in flight, kept across the sleep
    seconds: float = 0.0


class WakeReport(msgspec.Struct, kw_only=True):
    """What one ``backend.wake(...)`` did: the version it serves, whether it installed an
    update or fell back to the last good weights, the requests it restored."""

    level: int
    version: int
    updated: bool = False
    fallback: bool = False
    restored: int = 0
    seconds: float = 0.0
    # request id (a fleet: replica name) -> why it could not be restored (its stream fails)
    failed: dict[str, str] = {}


def _as_token_array(name: str, values: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """``values`` as ``Trajectory.<name>``'s dtype.  Into an integer array a conversion must
    keep every value (``np.ones(n)`` is fine; NaN, fractions and out-of-range integers raise
    ``ValueError`` instead of wrapping around in silence); into ``logprobs`` any numbers."""
    with np.errstate(invalid="ignore", over="ignore"):
        try:
            arr = np.asarray(values, dtype=dtype)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"Trajectory.{name} cannot be {dtype}: {exc}") from exc
        if dtype.kind in "iu":
            src = np.asarray(values)
            if src.dtype != dtype and src.size and not np.array_equal(arr, src):
                raise ValueError(
                    f"Trajectory.{name} must hold {dtype} values; converting its {src.dtype} "
                    "array would change some of them (NaN, fractions or out of range)"
                )
    return arr


def unicode_safe(text: str) -> str:
    """``text`` with every lone surrogate (os.listdir names, a ``"\\udcff"`` escape) replaced by
    ``"?"``: no tokenizer takes them, nor can a trajectory holding them be encoded."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode()
    return text


def new_id() -> str:
    """A random, globally unique identifier (32 hex digits)."""
    return uuid.uuid4().hex


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A call the model asked for; ``arguments`` is the decoded JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = {}


class Message(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One chat message in OpenAI shape (role system/user/assistant/tool)."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ToolSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A tool as the model sees it: name, description and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI function-calling format used by chat templates."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class Task(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One problem an environment poses; ``data`` is free-form, ``answer`` is for the reward."""

    id: str
    data: dict[str, Any] = {}
    answer: Any = None


class ExecResult(msgspec.Struct, kw_only=True):
    """Outcome of a sandboxed command.  A timeout is a result, not an exception."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = False
    elided_bytes: int = 0
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class ToolResult(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What a tool call returned to the model; ``error`` names the failure kind if any."""

    call_id: str
    name: str
    content: str
    error: str | None = None  # parse | unknown_tool | bad_arguments | exception | timeout
    duration: float = 0.0
    cached: bool = False  # from the result cache of a pure tool (not executed)


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One model turn.  ``[gen_start, gen_end)`` are the sampled tokens, ``[gen_end, env_end)``
    the environment's reply rendered after it (tool results or feedback)."""

    index: int
    gen_start: int
    gen_end: int
    env_end: int
    finish_reason: FinishReason
    text: str = ""
    tool_calls: list[ToolCall] = []
    tool_results: list[ToolResult] = []
    format_error: str | None = None
    gen_seconds: float = 0.0
    tool_seconds: float = 0.0
    env_seconds: float = 0.0


class Fork(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Where a sample began instead of extending another one: the conversation it was asked
    to continue is not the one that sample's tokens hold (``reason``: ``history_edited``
    the client changed or dropped earlier messages, ``tools_changed``, ``template_rewrites``
    the chat template renders the history differently once more is added, ``n`` one of
    several choices of a call, ``concurrent_call`` the sample it extends was generating).  ``common_tokens``: tokens the new sample shares with
    ``from_sample``'s; ``mismatched_tokens``: ``from_sample``'s tokens after them, which a
    re-tokenising proxy would have replaced silently."""

    from_sample: int
    at_call: int
    reason: str
    common_tokens: int = 0
    mismatched_tokens: int = 0


def _empty(name: str) -> Any:
    return msgspec.field(default_factory=lambda: np.zeros(0, TOKEN_ARRAY_DTYPES[name]))


class Trajectory(msgspec.Struct, kw_only=True, eq=False, gc=False):
    """A finished episode with per-token provenance.

    Per token: ``token_ids``, ``logprobs`` (NaN where not generated), ``loss_mask`` (1 exactly
    on sampled tokens), ``policy_version`` and ``kv_version`` (-1 where not generated).
    ``prompt_len`` is the length of the first rendered prompt.  ``forks``: how this sample
    began when it is not its episode's first (a rewritten history starts a new sample).

    A Trajectory and what it holds (Turn, Message, ToolCall, ToolResult) form a tree: these
    types are ``gc=False`` (the cyclic GC never walks them: a lease decodes thousands at a
    time), so a record stored inside itself would leak, not crash.  Per-token arrays are never
    encoded element by element.
    """

    id: str
    task_id: str
    group_id: str
    sample_index: int = 0
    seed: int = 0
    env_name: str = ""
    env_version: str = ""
    backend: str = ""
    status: Status = "ok"
    stop_reason: str = ""
    error: str | None = None
    reward: float = 0.0
    rewards: dict[str, float] = {}
    prompt_len: int = 0
    token_ids: np.ndarray = _empty("token_ids")
    logprobs: np.ndarray = _empty("logprobs")
    loss_mask: np.ndarray = _empty("loss_mask")
    policy_version: np.ndarray = _empty("policy_version")
    kv_version: np.ndarray = _empty("kv_version")
    turns: list[Turn] = []
    messages: list[Message] = []
    forks: list[Fork] = []
    started_at: float = 0.0
    finished_at: float = 0.0
    metrics: dict[str, float] = {}

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name, dtype in TOKEN_ARRAY_DTYPES.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                arr = _as_token_array(name, arr, dtype)
                setattr(self, name, arr)
            if arr.ndim != 1 or len(arr) != n:
                raise ValueError(
                    f"Trajectory.{name} has shape {arr.shape}; every per-token array must be "
                    f"1-D with len(token_ids)={n}"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def duration(self) -> float:
        return self.finished_at - self.started_at

    def min_policy_version(self) -> int:
        """Oldest policy version among sampled tokens (-1 if nothing was sampled)."""
        # a masked reduction over a bool view of the 0/1 mask: no temporary arrays (the
        # dtype is <i4, __post_init__ sees to it)
        low = int(self.policy_version.min(where=self.loss_mask.view(bool), initial=_I4_MAX))
        return -1 if low == _I4_MAX else low


# -- wire encoding ---------------------------------------------------------------------------


# the dtypes an array is written in as it is (little-endian or single-byte), with their names:
# one dict lookup per array instead of reading byteorder, flags and dtype.str (a new string
# each time), which took a quarter of a trajectory's encode
_WIRE_DTYPES: dict[np.dtype[Any], str] = {
    dt: dt.str
    for dt in (
        np.dtype(code).newbyteorder("<")
        for code in ("b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8")
    )
}


class _ArrayOut(msgspec.Struct, gc=False):
    """What an array is written as: ``{"dtype": ..., "data": <its bytes>}`` (a struct
    encodes ~0.3 us faster than the equivalent dict: its keys are pre-encoded)."""

    dtype: str
    data: memoryview


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        name = _WIRE_DTYPES.get(obj.dtype)
        data = obj.data
        if name is not None and data.c_contiguous:
            return _ArrayOut(name, data)
        if obj.dtype.byteorder == ">":  # C order too: astype keeps a transposed layout
            obj = obj.astype(obj.dtype.newbyteorder("<"), order="C")
        elif not obj.flags.c_contiguous:
            obj = np.ascontiguousarray(obj)
        # the array's own bytes (msgspec copies them into its output once; tobytes() was a
        # second full copy of every trajectory's arrays); msgspec writes any contiguous
        # buffer as raw bytes, whatever its item format
        return _ArrayOut(obj.dtype.str, obj.data)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def wire_dtype(name: object) -> np.dtype[Any]:
    """The dtype an array object on the wire names: a plain bool, integer or float type
    (``"<i4"``, ``"|u1"``, ``"<f4"`` ...).  Anything else -- not a string, not a dtype,
    structured (``"i4,i4"``), a sub-array, object, text or dates -- raises ``ValueError``: the
    name comes from the peer, and numpy's parser raises whatever it likes (a ``SyntaxError``
    for ``","``)."""
    if not isinstance(name, str):
        raise ValueError(f"an array's dtype must be a string, got {type(name).__name__}")
    try:
        dtype = np.dtype(name)
    except Exception as exc:  # numpy's dtype parser: TypeError, SyntaxError, ValueError ...
        raise ValueError(f"unknown array dtype {name[:40]!r}") from exc
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.shape != ():
        raise ValueError(f"unsupported array dtype {name[:40]!r}; use a bool, int or float type")
    return dtype


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray:
        if not isinstance(obj, dict) or "dtype" not in obj or "data" not in obj:
            raise ValueError("expected an array object {dtype, data}")
        data = obj["data"]
        if isinstance(data, str):  # JSON carries bytes as base64
            data = base64.b64decode(data)
        return np.frombuffer(data, dtype=wire_dtype(obj["dtype"])).copy()
    raise NotImplementedError(f"cannot decode {typ!r}")


_msgpack_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_json_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_decoders: dict[tuple[str, Any], Any] = {}


def encode_msgpack(obj: Any) -> bytes:
    """Encode a record (or a list of records) as msgpack."""
    return _msgpack_encoder.encode(obj)


def encode_json(obj: Any) -> bytes:
    """Encode a record as JSON (arrays as base64 packed bytes, so NaN survives)."""
    return _json_encoder.encode(obj)


def _decoder(fmt: str, typ: Any) -> Any:
    key = (fmt, typ)
    dec = _decoders.get(key)
    if dec is None:
        mod = msgspec.msgpack if fmt == "msgpack" else msgspec.json
        dec = _decoders[key] = mod.Decoder(typ, dec_hook=_dec_hook)
    return dec


def decode_msgpack(data: bytes, typ: Any) -> Any:
    """Decode msgpack ``data`` into ``typ``; raises ``msgspec.ValidationError`` on bad input."""
    return _decoder("msgpack", typ).decode(data)


def decode_json(data: bytes | str, typ: Any) -> Any:
    """Decode JSON ``data`` into ``typ``; raises ``msgspec.ValidationError`` on bad input."""
    return _decoder("json", typ).decode(data)


def now() -> float:
    """Wall-clock seconds (one place to patch in tests)."""
    return time.time()
