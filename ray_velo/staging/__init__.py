"""``@ray_velo.transfer``: transparent staging of large arguments and results of Ray calls
(docs/transfer.md; the protocol's mapping: docs/protocol.md §12).

May import: errors, config, _ray, protocol, state, local, client, api.
"""

from ray_velo.staging.resolution import (
    Resolution,
    discard_tree,
    resolve,
    resolve_stream,
    stage_tree,
)
from ray_velo.staging.tree import StagedValue, TransferOptions, visit, walk
from ray_velo.staging.wrappers import (
    TransferActorClass,
    TransferActorHandle,
    TransferFunction,
    transfer,
)

__all__ = [
    "Resolution",
    "StagedValue",
    "TransferActorClass",
    "TransferActorHandle",
    "TransferFunction",
    "TransferOptions",
    "discard_tree",
    "resolve",
    "resolve_stream",
    "stage_tree",
    "transfer",
    "visit",
    "walk",
]
