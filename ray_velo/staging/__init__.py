"""``@ray_velo.transfer``: transparent staging of large arguments and results of Ray calls
(docs/transfer.md; the protocol's mapping: docs/protocol.md §12).

May import: errors, config, _ray, protocol, state, local, client, api.
"""

from ray_velo.staging.resolution import resolve, resolve_stream
from ray_velo.staging.tree import StagedValue, TransferOptions
from ray_velo.staging.wrappers import transfer

__all__ = ["StagedValue", "TransferOptions", "resolve", "resolve_stream", "transfer"]
