"""The agent's services to the processes of its own node: producers that stage by writing
into shared memory, readers that lease slots in place, and caller-owned regions."""
