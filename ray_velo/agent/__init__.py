"""The core every service of an agent runs on: :class:`~.core.AgentCore` (the one lock, the
clock, the node's memory (:mod:`.node_memory`), the metrics, the pure states), the RDMA seam
(:mod:`.backend`), what may run on the event loop (:mod:`.nonblocking`), and how a Ray call to
an agent is waited on and its errors mapped (:mod:`.calls`).

May import: errors, config, protocol, metrics, memory, ucx, state.
"""
