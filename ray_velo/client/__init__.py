"""A worker's side of its node's agent: the session that reaches it (:mod:`.session`), how
values are packed into staged bytes and back (:mod:`.payload`), and the writable buffers a
worker fills or fetches into (:mod:`.writable`). The public functions over them are
:mod:`ray_velo.api`.

May import: errors, config, _ray, protocol, memory, agent, local, actors.
"""
