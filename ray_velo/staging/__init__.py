"""``@ray_velo.transfer``: transparent staging of large arguments and results of Ray calls.

Stack it above ``@ray.remote`` on a function, a generator or an actor class::

    @ray_velo.transfer                       # or @ray_velo.transfer(threshold_bytes=..., ...)
    @ray.remote
    def step(batch: np.ndarray) -> np.ndarray: ...

Arguments and results above the threshold (256 KiB; numpy arrays, bytes-likes and CPU
tensors, also inside lists, tuples and dicts) are staged on the sender's node agent and
replaced by a :class:`StagedValue`; the receiver resolves every StagedValue before the
body runs, so the body sees plain values, never a handle. A result comes back to the caller
as a StagedValue: a decorated callee resolves it as an argument, and the driver resolves it
with :func:`resolve` (which takes ObjectRefs too). Payloads at or under the threshold travel
as plain Ray values.

Mapping of the protocol's transparent staging (docs/protocol.md §12) onto Ray
(docs/architecture.md §3):

* ``_rv`` and ``_rv_budget_ms`` are the StagedValue's ``handle`` and ``budget_s``. They are
  taken out of the call before the body runs, so nothing the body forwards carries them.
* Single-use by default: a staged value has ``consumers`` references (1 unless fan-out asks
  for more). Each resolution claims one at the owner before the body runs, so resolution
  N+1 (concurrent or later, on any node, with or without a node-local copy) raises
  ``HandleReleased``. The claim is consumed after the body returned, and given back when Ray
  retries a failed task (or the worker died), so the retry resolves the same value again;
  what nothing consumes, the TTL frees (``ttl``, defaulting to ``fetch_timeout`` when set).
* ``fetch_timeout`` is the caller's budget; it travels with the value and bounds the
  receiver's fetch together with the agent-wide ``staged_fetch_timeout``.
* The receiver's ``staged_payload_max`` fails the task (or ends the stream) before anything
  of the payload's size is allocated, with both sizes in the error.
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
