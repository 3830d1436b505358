"""The agents' own TCP wire: TLS and Ray's token on every connection (:mod:`.auth`), and the
server that answers a peer's frames (:mod:`.server`). The frames and the handshake are pure
codecs in :mod:`ray_velo.protocol`.

May import: errors, protocol.
"""
