"""The errors of the emulated multi-host testbed (the bench and the tests), kept out of the
library's own error tree: no transfer ever raises them."""

from __future__ import annotations

from ray_velo.errors import VeloError

__all__ = ["TestbedError", "TestbedUnavailable"]


class TestbedError(VeloError, RuntimeError):
    """Building or running the emulated multi-host testbed failed. Fields: ``step``,
    ``detail``."""

    __test__ = False  # not a pytest test class

    def _describe(self) -> str:
        f = self.fields
        return f"testbed: {f.get('step')} failed: {f.get('detail')}"


class TestbedUnavailable(TestbedError):
    """This machine cannot make the testbed's network namespaces. Fields: ``reason``."""

    def _describe(self) -> str:
        return (
            f"cannot build the emulated multi-host testbed: {self.fields.get('reason')}. It "
            "needs root (CAP_NET_ADMIN) and the `ip` and `tc` commands (iproute2)"
        )
