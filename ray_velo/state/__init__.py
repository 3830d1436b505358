"""The agent's pure state, every piece of it: the owner's slot store (:mod:`.store`) and state
over it (:mod:`.owner`: slots, leases, grace, quarantine), its buffers' ledger (:mod:`.ledger`),
reservations, relays' records, reads and streamed writes in progress (:mod:`.progress`), the
consumer's node-side state (:mod:`.consumer`), the cross-node fetch as a machine
(:mod:`.fetch`), deadlines, and the whole assembled (:mod:`.agent`). No I/O, no Ray, no UCX, no
lock: time is an argument, effects are return values; the services above act on them.

May import: errors, protocol, memory.
"""
