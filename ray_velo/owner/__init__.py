"""The owner's role in an agent: the seven ``_rv_*`` handlers a peer's acquire, renew, read
and release reach (:mod:`.service`), and the sends of its bytes over the agents' wire
(:mod:`.sender`), over the pure state in :mod:`ray_velo.state`.

May import: errors, protocol, memory, wire, state, agent.
"""
