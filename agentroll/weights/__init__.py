"""Weight sync: full and delta updates, checksums, transactional apply, transports.

``agentroll.weights.http`` (httpx) and ``agentroll.weights.dist``
(torch.distributed) are imported on demand.
"""

from agentroll.errors import WeightSyncError
from agentroll.weights.apply import WeightStore
from agentroll.weights.delta import decode_into, encode_tensor
from agentroll.weights.exporter import WeightExporter
from agentroll.weights.transport import (
    DirectoryTransport,
    InProcessTransport,
    WeightReceiver,
    WeightSender,
    WeightTransport,
    read_update,
    write_update,
)
from agentroll.weights.update import TensorUpdate, WeightUpdate, model_digest, tensor_checksum

__all__ = [
    "DirectoryTransport",
    "InProcessTransport",
    "TensorUpdate",
    "WeightExporter",
    "WeightReceiver",
    "WeightSender",
    "WeightStore",
    "WeightSyncError",
    "WeightTransport",
    "WeightUpdate",
    "decode_into",
    "encode_tensor",
    "model_digest",
    "read_update",
    "tensor_checksum",
    "write_update",
]
