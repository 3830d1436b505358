"""The agents' own TCP wire: TLS and Ray's token on every connection (:mod:`.auth`), the
server that answers a peer's frames (:mod:`.server`), the bulk port that sends payload bytes
(:mod:`.bulk`), and exact reads from a socket (:mod:`.io`). The frames and the handshake are pure
codecs in :mod:`ray_velo.protocol`.

May import: errors, protocol.
"""
