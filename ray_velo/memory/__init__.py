"""Staging memory: shared-memory arenas, the registered arena pool and caller-owned regions. No
Ray, no UCX: the UCX backend plugs in as a :class:`~.pool.Registrar` (docs/architecture.md §2).

May import: errors, config, protocol.
"""
