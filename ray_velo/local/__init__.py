"""The agent's services to the processes of its own node: producers that stage by writing
into shared memory, readers that lease slots in place, and caller-owned regions; the Unix
socket a worker reaches them by (:mod:`.channel`) and the records they hand out
(:mod:`.records`).

May import: errors, protocol, memory, state, agent.
"""
