"""The pure protocol core: no I/O, no clock, no Ray, no UCX (a test proves it); time and facts
are arguments, decisions are return values.

May import: errors.
"""

from ray_velo.protocol.descriptor import (
    BACKEND_UCX,
    DESCRIPTOR_HEADER_BYTES,
    DESCRIPTOR_VERSION,
    MAX_DESCRIPTOR_RKEY_BYTES,
    RdmaDescriptor,
)
from ray_velo.protocol.handle import DataHandle, HandleMetadata
from ray_velo.protocol.killswitch import KILL_SWITCH_ENV, kill_switch_engaged
from ray_velo.protocol.messages import (
    AcquireRequest,
    CopyNotice,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    MetadataResponse,
    PullRequest,
    Rdma,
    RdmaOffer,
    ReadRequest,
    Ready,
    RefRequest,
    RelayEnd,
    RelayProgress,
    RelayRequest,
    ReleaseRequest,
    TypeHeader,
    WindowAnswer,
    WindowRequest,
    decode,
    decode_acquire_response,
    encode,
)
from ray_velo.protocol.path import (
    OFFER_UCX,
    OFFER_WIRE,
    ConsumerOffer,
    OwnerFacts,
    PathDecision,
    build_offer,
    decide_path,
)

__all__ = [
    "BACKEND_UCX",
    "DESCRIPTOR_HEADER_BYTES",
    "DESCRIPTOR_VERSION",
    "KILL_SWITCH_ENV",
    "MAX_DESCRIPTOR_RKEY_BYTES",
    "OFFER_UCX",
    "OFFER_WIRE",
    "AcquireRequest",
    "ConsumerOffer",
    "CopyNotice",
    "DataHandle",
    "DetachRequest",
    "HandleMetadata",
    "LeaseRenewRequest",
    "MetadataRequest",
    "MetadataResponse",
    "OwnerFacts",
    "PathDecision",
    "PullRequest",
    "Rdma",
    "RdmaDescriptor",
    "RdmaOffer",
    "ReadRequest",
    "Ready",
    "RefRequest",
    "RelayEnd",
    "RelayProgress",
    "RelayRequest",
    "ReleaseRequest",
    "TypeHeader",
    "WindowAnswer",
    "WindowRequest",
    "build_offer",
    "decide_path",
    "decode",
    "decode_acquire_response",
    "encode",
    "kill_switch_engaged",
]
