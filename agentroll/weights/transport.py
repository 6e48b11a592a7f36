"""Weight transports: moving a ``WeightUpdate`` between processes, verified in transit, plus
the wire header and byte-stream framing that HTTP and torch.distributed share.
Invariants: a receiver never returns a partial update (every payload is checked against a
transport-level length and xxh3-128); a directory update appears all at once; blocking work
runs off the event loop and no worker thread outlives the call that started it; a
``FrameDecoder`` judges a header before it takes a payload byte.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Literal, Self, TypeVar

import msgspec
import numpy as np
import xxhash

from agentroll._fs import fsync_path
from agentroll.errors import WeightSyncError
from agentroll.weights.delta import payload_bound
from agentroll.weights.update import DTYPES, Encoding, TensorUpdate, UpdateKind, WeightUpdate

FORMAT = "agentroll.weights/1"
#: stream preamble: MAGIC, then the header length as little-endian u64, then the header
MAGIC = b"ARWU\x00\x00\x00\x01"
MAX_HEADER_BYTES = 64 << 20
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_T = TypeVar("_T")
#: the TensorUpdate fields a header carries: all but the payload
_TENSOR_FIELDS = tuple(f for f in TensorUpdate.__struct_fields__ if f != "payload")


class PayloadInfo(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Everything about one tensor except its payload, plus the payload's transport integrity:
    ``length`` and ``xxh3`` (hex xxh3-128 of the payload bytes).  ``file`` is used only in a
    directory manifest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    compression: Literal["none", "zstd"]
    num_changed: int
    checksum: str
    length: Annotated[int, msgspec.Meta(ge=0)]
    xxh3: str
    file: str | None = None


class UpdateHeader(msgspec.Struct, kw_only=True, frozen=True):
    """The metadata frame of an update (also the directory ``manifest.json``)."""

    format: str
    version: int
    base_version: int
    kind: UpdateKind
    digest: str
    tensors: tuple[PayloadInfo, ...]


def describe(update: WeightUpdate) -> UpdateHeader:
    """The header of ``update``, hashing every payload (CPU bound: call it off the loop)."""
    names = [t.name for t in update.tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"update v{update.version} names a tensor twice")
    infos = tuple(
        PayloadInfo(
            length=len(t.payload),
            xxh3=xxhash.xxh3_128_hexdigest(t.payload),
            **{f: getattr(t, f) for f in _TENSOR_FIELDS},
        )
        for t in update.tensors
    )
    return UpdateHeader(
        format=FORMAT,
        version=update.version,
        base_version=update.base_version,
        kind=update.kind,
        digest=update.digest,
        tensors=infos,
    )


def assemble(
    header: UpdateHeader, payloads: Sequence[bytes | bytearray], *, verified: bool = False
) -> WeightUpdate:
    """Verify every payload against ``header`` (unless the caller already did) and build the
    update (all or nothing)."""
    tensors = []
    for info, payload in zip(header.tensors, payloads, strict=True):
        if not verified and len(payload) != info.length:
            raise WeightSyncError(
                f"payload of {info.name!r} is {len(payload)} bytes, not {info.length}"
            )
        if not verified and xxhash.xxh3_128_hexdigest(payload) != info.xxh3:
            raise WeightSyncError(f"payload of {info.name!r} is corrupt (xxh3 mismatch)")
        fields = {f: getattr(info, f) for f in _TENSOR_FIELDS}
        tensors.append(TensorUpdate(payload=payload, **fields))
    return WeightUpdate(
        version=header.version,
        base_version=header.base_version,
        kind=header.kind,
        tensors=tuple(tensors),
        digest=header.digest,
    )


def decode_header(data: bytes, *, json: bool = False) -> UpdateHeader:
    """Parse and validate a header frame (msgpack) or manifest (JSON)."""
    decoder = msgspec.json.Decoder(UpdateHeader) if json else msgspec.msgpack.Decoder(UpdateHeader)
    try:
        header = decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise WeightSyncError(f"malformed update header: {exc}") from exc
    if header.format != FORMAT:
        raise WeightSyncError(f"unsupported update format {header.format!r}, expected {FORMAT!r}")
    return header


def encode_frames(
    update: WeightUpdate, header: UpdateHeader, *, chunk_bytes: int = 1 << 20
) -> Iterator[bytes]:
    """The byte stream ``MAGIC | u64le len(H) | H=msgpack(header) | payload_0 | payload_1 ...``
    in chunks of at most ``chunk_bytes`` (payloads in header order, no padding)."""
    head = msgspec.msgpack.encode(header)
    yield MAGIC + struct.pack("<Q", len(head)) + head
    for tensor in update.tensors:
        view = memoryview(tensor.payload)
        for start in range(0, len(view), chunk_bytes):
            yield bytes(view[start : start + chunk_bytes])


class UpdateRefusedError(WeightSyncError):
    """The receiver refuses the update its header describes (a wrong base version, tensors
    that do not match its model); raised before any payload byte is read (HTTP 409)."""


class UpdateTooLargeError(WeightSyncError):
    """The header declares more bytes than the receiver takes, in all or for one tensor;
    raised before any payload byte is read (HTTP 413)."""


def check_sizes(header: UpdateHeader, *, max_bytes: int | None = None, hint: str = "") -> int:
    """Validate the tensors ``header`` declares and return its payload bytes: names unique,
    dtypes supported, shapes non-negative (``WeightSyncError``); no payload longer than its
    tensor can take (``payload_bound``) and, given ``max_bytes``, no more than that in all
    (``UpdateTooLargeError``, its message ending with ``hint``)."""
    names = {info.name for info in header.tensors}
    if len(names) != len(header.tensors):
        raise WeightSyncError(f"update v{header.version} names a tensor twice")
    total = 0
    for info in header.tensors:
        if info.dtype not in DTYPES:
            raise WeightSyncError(f"tensor {info.name!r} has unsupported dtype {info.dtype!r}")
        if any(d < 0 for d in info.shape):
            raise WeightSyncError(f"tensor {info.name!r} has a negative dimension {info.shape}")
        numel = math.prod(info.shape)
        bound = payload_bound(
            info.encoding, info.compression, numel, DTYPES[info.dtype][1].itemsize
        )
        if info.length > bound:
            raise UpdateTooLargeError(
                f"tensor {info.name!r} ({info.dtype}{list(info.shape)}) declares a "
                f"{info.length}-byte {info.encoding} payload, but one takes at most {bound} "
                "bytes; send the tensor's own bytes (full) or a delta from encode_tensor"
            )
        total += info.length
    if max_bytes is not None and total > max_bytes:
        raise UpdateTooLargeError(
            f"update v{header.version} declares {total} payload bytes, more than the "
            f"{max_bytes}-byte limit{hint}; send a delta, or raise the limit"
        )
    return total


class FrameDecoder:
    """Incremental decoder of ``encode_frames`` output: ``feed`` chunks of any size, then
    ``finish``.  With ``header`` given, the stream holds the payloads only (torch.distributed
    sends the header separately).

    Everything the header declares is checked before a payload byte is taken: the sizes
    (``check_sizes`` with ``max_bytes``), then ``check(header)``, whose ``WeightSyncError``
    comes out as ``UpdateRefusedError``.  Each payload is received into one buffer of its
    declared length (no copies joined at the end) and verified as soon as it is complete, so
    the decoder holds at most the update's payloads (``buffered_bytes``)."""

    def __init__(
        self,
        header: UpdateHeader | None = None,
        *,
        check: Callable[[UpdateHeader], None] | None = None,
        max_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        hint: str = "",
    ) -> None:
        self.header: UpdateHeader | None = None
        self._check = check
        self._max_bytes = max_bytes
        self._max_header_bytes = max_header_bytes
        self._hint = hint
        self._stage: Literal["preamble", "header", "payload", "done"] = "preamble"
        self._need = len(MAGIC) + 8
        self._head = bytearray()  # the preamble, then the header frame, as it arrives
        self._buffer = bytearray()  # the payload in progress, allocated at its full length
        self._have = 0
        self._payloads: list[bytearray] = []
        self._held = 0
        self._hasher = xxhash.xxh3_128()
        if header is not None:
            self._accept(header)

    @property
    def buffered_bytes(self) -> int:
        """Bytes this decoder holds now: the header so far, every payload buffer."""
        return len(self._head) + self._held

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        while len(view):
            if self._stage == "done":
                raise WeightSyncError(f"{len(view)} unexpected bytes after the last payload")
            take = min(self._need - self._have, len(view))
            if self._stage == "payload":
                piece = view[:take]
                self._buffer[self._have : self._have + take] = piece
                self._hasher.update(piece)  # hash as bytes arrive: no pause at the end
            else:
                self._head += view[:take]
            self._have += take
            view = view[take:]
            if self._have == self._need:
                self._complete()

    def finish(self) -> WeightUpdate:
        """The verified update; ``WeightSyncError`` if the stream stopped early."""
        if self._stage != "done" or self.header is None:
            missing = self._need - self._have
            raise WeightSyncError(
                f"update stream truncated in {self._stage} ({missing} bytes short)"
            )
        return assemble(self.header, self._payloads, verified=True)

    def _complete(self) -> None:
        self._have = 0
        if self._stage == "preamble":
            if self._head[: len(MAGIC)] != MAGIC:
                raise WeightSyncError("not an agentroll weight update stream (bad magic)")
            (self._need,) = struct.unpack("<Q", self._head[len(MAGIC) :])
            self._head = bytearray()
            if self._need == 0:
                raise WeightSyncError("empty update header")
            if self._need > self._max_header_bytes:
                raise UpdateTooLargeError(
                    f"update header of {self._need} bytes exceeds the "
                    f"{self._max_header_bytes}-byte limit; send fewer or shorter-named tensors"
                )
            self._stage = "header"
        elif self._stage == "header":
            header = decode_header(bytes(self._head))
            self._head = bytearray()
            self._accept(header)
        else:
            assert self.header is not None
            info = self.header.tensors[len(self._payloads)]
            if self._hasher.hexdigest() != info.xxh3:
                raise WeightSyncError(f"payload of {info.name!r} is corrupt (xxh3 mismatch)")
            self._hasher.reset()
            self._payloads.append(self._buffer)
            self._buffer = bytearray()
            self._next_payload()

    def _accept(self, header: UpdateHeader) -> None:
        """Check what ``header`` declares, then expect its payloads."""
        check_sizes(header, max_bytes=self._max_bytes, hint=self._hint)
        if self._check is not None:
            try:
                self._check(header)
            except UpdateRefusedError:
                raise
            except WeightSyncError as exc:
                raise UpdateRefusedError(str(exc)) from exc
        self.header = header
        self._stage = "payload"
        self._next_payload()

    def _next_payload(self) -> None:
        assert self.header is not None
        tensors = self.header.tensors
        # empty payloads (a delta that changes nothing) complete without any bytes
        while len(self._payloads) < len(tensors) and tensors[len(self._payloads)].length == 0:
            self._payloads.append(bytearray())
        if len(self._payloads) == len(tensors):
            self._stage, self._need = "done", 0
        else:
            self._need = tensors[len(self._payloads)].length
            # one allocation of the declared (checked) length: bytes are copied in once
            self._buffer = bytearray(self._need)
            self._held += self._need


async def run_blocking(fn: Callable[..., _T], /, *args: object) -> _T:
    """Run ``fn(*args)`` in a worker thread.  On cancellation, wait for the thread to finish
    (its work cannot be interrupted) and then re-raise, so no thread outlives the call."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future})
        raise


class WeightSender(abc.ABC):
    """The producer half: ``send`` returns once the update has been handed over (in-process),
    committed (directory), or accepted by the receiver (HTTP, torch.distributed)."""

    @abc.abstractmethod
    async def send(self, update: WeightUpdate) -> None: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release connections or files; the default has nothing to release."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class WeightReceiver(abc.ABC):
    """The consumer half: ``receive`` waits for the next update and returns it only after
    every payload has been verified; otherwise it raises ``WeightSyncError``.

    The transport-level xxh3-128 is of the payload bytes, distinct from the tensor checksum
    that ``apply`` verifies; any truncated, corrupt or incomplete transfer raises
    ``WeightSyncError``.  A directory update is written to a temp dir and ``os.rename``d.
    """

    @abc.abstractmethod
    async def receive(self) -> WeightUpdate: ...


class WeightTransport(WeightSender, WeightReceiver):
    """Both halves; HTTP is send-only (the receiver is the stream's ``POST /v1/weights``)."""


class InProcessTransport(WeightTransport):
    """Object handoff through a bounded queue: ``send`` blocks while ``maxsize`` updates wait.
    ``verify`` hashes payloads on send and checks them on receive, so this transport obeys the
    same contract as the others (cheap: xxh3 runs at memory speed)."""

    def __init__(self, maxsize: int = 1, *, verify: bool = True) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self._queue: asyncio.Queue[tuple[WeightUpdate, UpdateHeader | None]]
        self._queue = asyncio.Queue(maxsize)
        self._verify = verify

    async def send(self, update: WeightUpdate) -> None:
        header = await run_blocking(describe, update) if self._verify else None
        await self._queue.put((update, header))

    async def receive(self) -> WeightUpdate:
        update, header = await self._queue.get()
        if header is None:
            return update
        return await run_blocking(assemble, header, [t.payload for t in update.tensors])


def write_update(update: WeightUpdate, root: str | Path, *, file_bytes: int = 1 << 30) -> Path:
    """Write ``update`` to ``root/v{version}/`` atomically and return that path: payloads as
    uint8 tensors in ``payloads-NNNNN.safetensors`` files of at most ~``file_bytes`` each
    (one payload is never split), then ``manifest.json``, fsynced, then one ``os.rename``.
    Raises ``WeightSyncError`` if the version exists or the write fails (nothing is left)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{update.version}"
    if final.exists():
        raise WeightSyncError(f"update v{update.version} already exists in {root}")
    header = describe(update)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{update.version}-", suffix=".tmp", dir=root))
    try:
        groups: list[list[int]] = [[]]
        size = 0
        for i, info in enumerate(header.tensors):
            if groups[-1] and size + info.length > file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += info.length
        infos = list(header.tensors)
        for n, group in enumerate(groups):
            fname = f"payloads-{n:05d}.safetensors"
            arrays = {
                infos[i].name: np.frombuffer(update.tensors[i].payload, dtype=np.uint8)
                for i in group
            }
            save_file(arrays, str(tmp / fname))
            fsync_path(tmp / fname)
            for i in group:
                infos[i] = msgspec.structs.replace(infos[i], file=fname)
        manifest = msgspec.structs.replace(header, tensors=tuple(infos))
        (tmp / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        fsync_path(tmp / MANIFEST)
        os.rename(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError | SafetensorError):
            raise WeightSyncError(f"cannot write update v{update.version}: {exc}") from exc
        raise
    # durability is best effort here: some filesystems refuse fsync on a directory
    with contextlib.suppress(OSError):
        fsync_path(root)
    return final


def read_update(path: str | Path) -> WeightUpdate:
    """Read and verify the update in ``path`` (a ``v{version}/`` directory written by
    ``write_update``).  Raises ``WeightSyncError`` on a missing or malformed manifest, a
    missing file, or any payload that does not match the manifest."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        header = decode_header((path / MANIFEST).read_bytes(), json=True)
    except OSError as exc:
        raise WeightSyncError(f"cannot read {path / MANIFEST}: {exc}") from exc
    match = _VERSION_DIR.match(path.name)
    if match and int(match.group(1)) != header.version:
        raise WeightSyncError(f"{path} holds version {header.version}")
    payloads: dict[str, bytes] = {}
    by_file: dict[str, list[PayloadInfo]] = {}
    for info in header.tensors:
        if not info.file or info.file.startswith(".") or Path(info.file).name != info.file:
            raise WeightSyncError(f"manifest names a bad payload file {info.file!r}")
        by_file.setdefault(info.file, []).append(info)
    try:
        for fname, infos in by_file.items():
            with safe_open(str(path / fname), framework="numpy") as f:
                for info in infos:
                    array = f.get_tensor(info.name)
                    if array.dtype != np.uint8 or array.ndim != 1:
                        raise WeightSyncError(f"payload of {info.name!r} is not a uint8 vector")
                    payloads[info.name] = array.tobytes()
    except (OSError, SafetensorError) as exc:
        raise WeightSyncError(f"cannot read update payloads in {path}: {exc}") from exc
    return assemble(header, [payloads[t.name] for t in header.tensors])


def available_versions(root: str | Path) -> list[int]:
    """Versions of the complete updates under ``root``, ascending (temp dirs are ignored)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n)))


class DirectoryTransport(WeightTransport):
    """A shared directory: ``send`` commits ``root/v{version}/``; ``receive`` returns the next
    version above the last one received (starting after ``after_version``), in version order
    so delta updates chain, polling every ``poll_interval`` seconds until one appears.  A
    corrupt version raises ``WeightSyncError`` on every ``receive`` until the caller moves
    ``last_version`` past it (a full update can then rebase the replica)."""

    def __init__(
        self, root: str | Path, *, after_version: int = -1, poll_interval: float = 0.05
    ) -> None:
        self.root = Path(root)
        self.last_version = after_version
        self.poll_interval = poll_interval

    async def send(self, update: WeightUpdate) -> None:
        await run_blocking(write_update, update, self.root)

    async def receive(self) -> WeightUpdate:
        while True:
            versions = await run_blocking(available_versions, self.root)
            newer = [v for v in versions if v > self.last_version]
            if newer:
                update = await run_blocking(read_update, self.root / f"v{newer[0]}")
                self.last_version = update.version
                return update
            await asyncio.sleep(self.poll_interval)
