"""Trajectory stream: rollout workers serve finished trajectories, trainers lease and ack them.

Worker API (``stream_app``; all bodies msgpack, JSON with ``Accept``/``Content-Type:
application/json``): ``POST /v1/lease`` (``max``, ``wait``, ``trainer_version``; 200
``LeaseBatch`` or 204), ``POST /v1/ack`` (``{"ids": [...]}`` -> ``{"acked": n}``),
``POST /v1/weights`` (a streamed ``WeightUpdate``), ``GET /v1/status``, ``GET /metrics``.
Invariant: a trajectory is fsync'd to the spool before it is offered and leaves it only when
acknowledged; the client dedupes by id, so a consumer sees each trajectory exactly once.
"""

from agentroll.stream.client import (
    AckReply,
    AckRequest,
    LeaseBatch,
    LeaseRequest,
    StreamClient,
    StreamError,
    Undecodable,
)
from agentroll.stream.server import StreamConfig, TrajectoryStream, serve_stream, stream_app
from agentroll.stream.spool import Spool, SpoolConfig, SpoolRecord, SpoolStats

__all__ = [
    "AckReply",
    "AckRequest",
    "LeaseBatch",
    "LeaseRequest",
    "Spool",
    "SpoolConfig",
    "SpoolRecord",
    "SpoolStats",
    "StreamClient",
    "StreamConfig",
    "StreamError",
    "TrajectoryStream",
    "Undecodable",
    "serve_stream",
    "stream_app",
]
