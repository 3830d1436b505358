"""An emulated multi-host Ray cluster on one machine, for the bench and the tests; it needs root
(docs/benchmarks.md, "The testbed").

May import: errors, memory, ucx, wire, api.
"""

from ray_velo.testbed.cluster import ENV_VAR, Host, Testbed, TestbedInfo, connect
from ray_velo.testbed.errors import TestbedError, TestbedUnavailable
from ray_velo.testbed.netns import LINK_RATES, check_privileges, remove_stale_networks

__all__ = [
    "ENV_VAR",
    "LINK_RATES",
    "Host",
    "Testbed",
    "TestbedError",
    "TestbedInfo",
    "TestbedUnavailable",
    "check_privileges",
    "connect",
    "remove_stale_networks",
]
