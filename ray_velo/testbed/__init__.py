"""An emulated multi-host Ray cluster on one machine, for the bench and the tests.

Two Ray nodes on one host move bytes through shared memory and CMA, a path no two real hosts
have. The testbed gives each emulated host its own network namespace, joins them with veth
links shaped to a rate (``tc tbf``), starts a Ray node in each with ``ray start``, and has UCX
use TCP on those links, as it would between two Ethernet hosts without RDMA NICs::

    from ray_velo.testbed import Testbed

    with Testbed(hosts=2, link="10gbit") as testbed:
        done = testbed.run([sys.executable, "my_driver.py"])   # runs inside host a

A driver joins with :func:`connect`. It needs root (CAP_NET_ADMIN); without it
:class:`~ray_velo.testbed.TestbedUnavailable` says so.
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
