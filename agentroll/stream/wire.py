"""The stream's wire format: request and reply records, and the fast decoding of a lease.

Invariants: the records are shared by the worker (``server``) and the client; the mirror
structs ``decode_lease`` decodes into derive from ``Trajectory``'s fields, so they cannot
drift from it; a lease decodes either whole or, through ``split_lease``, per trajectory.
"""

from __future__ import annotations

import gc
import typing
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from agentroll.types import TOKEN_ARRAY_DTYPES, Trajectory, wire_dtype

WireFormat = Literal["msgpack", "json"]


MSGPACK = "application/msgpack"
JSON = "application/json"


class LeaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/lease`` (query parameters of the same names override it)."""

    max: Annotated[int, msgspec.Meta(ge=1)] = 64
    wait: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    trainer_version: Annotated[int, msgspec.Meta(ge=0)] | None = None


class LeaseBatch(msgspec.Struct, kw_only=True):
    """A lease: ack its trajectories by id within ``ttl`` seconds (``expires_at``: the
    worker's wall clock) or they are offered again."""

    lease_id: str
    expires_at: float
    ttl: float
    trainer_version: int
    trajectories: list[Trajectory]


class AckRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/ack``."""

    ids: list[str]


class AckReply(msgspec.Struct, kw_only=True):
    """Reply of ``POST /v1/ack``: how many trajectories left the worker's spool."""

    acked: int


class _RawLeaseBatch(msgspec.Struct, kw_only=True):
    """A lease body whose trajectories are left undecoded (finding the ones that fail)."""

    lease_id: str
    expires_at: float
    ttl: float
    trainer_version: int
    trajectories: list[msgspec.Raw]


class _IdOnly(msgspec.Struct):
    id: str


class Undecodable(msgspec.Struct, frozen=True):
    """A leased trajectory this client could not decode: its id, why, and its bytes as
    they came (msgpack or JSON)."""

    id: str
    error: str
    data: bytes


OnUndecodable = Literal["raise", "skip"]


def _wire_types(data: type, skip: tuple[str, ...] = ()) -> tuple[type, type]:
    """Mirror structs of ``Trajectory`` and ``LeaseBatch`` whose per-token arrays decode as
    ``{dtype, data}`` with ``data`` of type ``data`` (derived from the fields of
    ``Trajectory``, so they cannot drift from it).  Fields in ``skip`` are left out: msgspec
    steps over them in the body without building their objects."""
    tag = f"{data.__name__}{'_' if skip else ''}{'_'.join(skip)}"
    array = msgspec.defstruct(f"_WireArray_{tag}", [("dtype", str), ("data", data)], gc=False)
    hints = typing.get_type_hints(Trajectory)
    fields: list[Any] = []
    for f in msgspec.structs.fields(Trajectory):
        if f.name in skip:
            continue
        typ = array if f.name in TOKEN_ARRAY_DTYPES else hints[f.name]
        if f.required:
            fields.append((f.name, typ))
        elif f.name in TOKEN_ARRAY_DTYPES:
            fields.append((f.name, typ | None, None))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ, f.default))
    traj = msgspec.defstruct(f"_WireTrajectory_{tag}", fields, kw_only=True, gc=False)
    batch = msgspec.defstruct(
        f"_WireLeaseBatch_{tag}",
        [
            (f.name, list[traj] if f.name == "trajectories" else f.type)  # type: ignore[valid-type]
            for f in msgspec.structs.fields(LeaseBatch)
        ],
        kw_only=True,
    )
    return traj, batch


#: the fields ``conversation=False`` leaves out: a trajectory's turns and messages are about
#: 85 of the ~110 Python objects a decoded trajectory is made of (its token arrays are 15)
CONVERSATION_FIELDS = ("turns", "messages")
_SKIPPED: dict[bool, tuple[str, ...]] = {True: (), False: CONVERSATION_FIELDS}
# msgpack: arrays are zero-copy views of the (writable) response buffer; JSON: base64 is
# decoded straight into one bytearray per array.  Indexed by ``conversation``.
_MSGPACK_WIRE = {c: _wire_types(memoryview, skip) for c, skip in _SKIPPED.items()}
_JSON_WIRE = {c: _wire_types(bytearray, skip) for c, skip in _SKIPPED.items()}
_MSGPACK_LEASE: dict[bool, msgspec.msgpack.Decoder[Any]] = {
    c: msgspec.msgpack.Decoder(types[1]) for c, types in _MSGPACK_WIRE.items()
}
_JSON_LEASE: dict[bool, msgspec.json.Decoder[Any]] = {
    c: msgspec.json.Decoder(types[1]) for c, types in _JSON_WIRE.items()
}
# one trajectory of a lease body, decoded as decode_lease does (split_lease, the slow path)
_MSGPACK_ITEM: dict[bool, msgspec.msgpack.Decoder[Any]] = {
    c: msgspec.msgpack.Decoder(types[0]) for c, types in _MSGPACK_WIRE.items()
}
_JSON_ITEM: dict[bool, msgspec.json.Decoder[Any]] = {
    c: msgspec.json.Decoder(types[0]) for c, types in _JSON_WIRE.items()
}
_DTYPES: dict[str, np.dtype[Any]] = {}
_ARRAY_FIELDS = tuple(TOKEN_ARRAY_DTYPES)


def _dtype(name: str) -> np.dtype[Any]:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = wire_dtype(name)
        if len(_DTYPES) < 64:
            _DTYPES[name] = dtype
    return dtype


def _trajectories(wires: list[Any]) -> list[Trajectory]:
    """The ``Trajectory`` of each decoded wire trajectory (its arrays: views of their data)."""
    asdict, frombuffer, dtypes = msgspec.structs.asdict, np.frombuffer, _DTYPES
    out = []
    for w in wires:
        fields = asdict(w)
        for name in _ARRAY_FIELDS:
            arr = fields[name]
            if arr is None:
                del fields[name]
            else:
                fields[name] = frombuffer(arr.data, dtypes.get(arr.dtype) or _dtype(arr.dtype))
        out.append(Trajectory(**fields))
    return out


def decode_lease(
    data: bytes | bytearray, *, json: bool = False, conversation: bool = True
) -> LeaseBatch:
    """Decode a ``LeaseBatch`` body (msgpack, or JSON with ``json``) like
    ``decode_msgpack(data, LeaseBatch)`` but ~3x faster: per-token arrays are not copied out
    of ``data``.  With msgpack they are writable views of one bytearray holding the body
    (``data`` itself if it is a bytearray, else a copy of it), kept alive by the arrays: the
    batch's memory is freed when its last array is (``arr.copy()`` to detach one).  With
    JSON each array owns the bytearray its base64 decodes into.  ``conversation=False``
    leaves each trajectory's ``turns`` and ``messages`` empty: they are stepped over in the
    body (still checked to be well-formed msgpack or JSON), never built.  Raises
    ``msgspec.ValidationError`` or ``ValueError`` on a malformed body."""
    # everything decoded here stays alive: the cyclic GC, which would run several full
    # passes over the batch's objects while they are built, waits until the end
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        if json:
            wire = _JSON_LEASE[conversation].decode(data)
        else:
            buffer = data if isinstance(data, bytearray) else bytearray(data)
            wire = _MSGPACK_LEASE[conversation].decode(buffer)
        wire.trajectories = _trajectories(wire.trajectories)
        return LeaseBatch(**msgspec.structs.asdict(wire))
    finally:
        if gc_enabled:
            gc.enable()


def split_lease(
    data: bytes | bytearray, *, json: bool = False, conversation: bool = True
) -> tuple[LeaseBatch, list[Undecodable]]:
    """A lease body that ``decode_lease`` refused, one trajectory at a time: the batch of
    those that decode and the ones that do not (a field of another type, another version's
    record).  Raises ``ValueError`` when the body is not a lease at all, or a trajectory's id
    cannot be read (it could not be acknowledged)."""
    mod: Any = msgspec.json if json else msgspec.msgpack
    try:
        raw = mod.decode(data, type=_RawLeaseBatch)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not a lease body: {exc}") from exc
    item_decoder = (_JSON_ITEM if json else _MSGPACK_ITEM)[conversation]
    good: list[Trajectory] = []
    bad: list[Undecodable] = []
    for item in raw.trajectories:
        blob = bytes(item)
        try:
            # as decode_lease decodes it (a conversation-less consumer steps over the turns
            # and messages); msgpack arrays: views of a writable copy of the record
            good += _trajectories([item_decoder.decode(blob if json else bytearray(blob))])
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            try:
                tid = mod.decode(blob, type=_IdOnly).id
            except msgspec.MsgspecError:
                raise ValueError(f"a leased trajectory without a readable id: {exc}") from exc
            bad.append(Undecodable(tid, str(exc), blob))
    fields = msgspec.structs.asdict(raw)
    fields["trajectories"] = good
    return LeaseBatch(**fields), bad
