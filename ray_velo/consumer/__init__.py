"""The consumer's role in an agent: the driver that performs a cross-node fetch
(:mod:`.driver`, the machine itself is :mod:`ray_velo.state.fetch`), the owners it talks to
(:mod:`.links`, :mod:`.peers`), reads over the agents' wire (:mod:`.bulk`), read windows
(:mod:`.windows`), relays (:mod:`.relay`) and the role's entry points (:mod:`.service`).

May import: errors, protocol, memory, wire, state, agent, local, owner.
"""
