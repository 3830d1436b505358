"""The consumer side: a cross-node fetch as a pure machine (:mod:`.fetch`), the driver that
performs it (:mod:`.driver`), the owners it talks to (:mod:`.links`, :mod:`.peers`), and the
agent's consumer role (:mod:`.service`)."""
