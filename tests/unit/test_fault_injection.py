"""Fault injection is a test's, never a production agent's: an agent built without a fault
plan (every agent ``rv.init`` starts, unless ``VeloConfig(fault_injection=True)``) wraps
nothing and refuses ``inject_fault``; no module of the library imports ``ray_velo.testing``
but under type checking."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

import ray_velo
from ray_velo.actors.agent import RendezvousAgent
from ray_velo.actors.faults import FaultyRdma
from ray_velo.errors import ConfigError
from ray_velo.owner.service import OwnerService
from ray_velo.testing import AgentPair, FakeRdma
from ray_velo.testing.pair import default_config

ROOT = pathlib.Path(ray_velo.__file__).parent


def test_an_agent_built_without_faults_wraps_nothing_and_refuses_them(tmp_path: Any) -> None:
    config = default_config().replace(shm_dir=str(tmp_path))
    agent = RendezvousAgent(config, "node-x", rdma=FakeRdma(), timer=False)
    try:
        assert not isinstance(agent.core.rdma, FaultyRdma)
        assert type(agent.owner) is OwnerService
        with pytest.raises(ConfigError, match="fault_injection"):
            agent.inject_fault("fail_gets", 1)
    finally:
        agent.shutdown()


def test_a_test_agent_arms_its_faults_and_refuses_unknown_ones(tmp_path: Any) -> None:
    with AgentPair(tmp_path) as pair:
        assert isinstance(pair.owner.core.rdma, FaultyRdma)  # wrapped when built
        pair.owner.inject_fault("fail_gets", 1)
        with pytest.raises(ValueError, match="unknown fault"):
            pair.owner.inject_fault("no_such_fault", 1)


def _runtime_imports_of_testing(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that import ray_velo.testing outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    lines = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray_velo.testing"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Import):
            lines += [node.lineno for a in node.names if a.name.startswith("ray_velo.testing")]
    return lines


def test_no_library_module_imports_the_test_doubles_at_run_time() -> None:
    files = set(ROOT.rglob("*.py")) | set((ROOT / "actors").resolve().rglob("*.py"))
    offenders = {
        str(p): lines
        for p in sorted(files)
        if "testing" not in p.relative_to(p.parents[1]).parts[:1] and p.parent.name != "testing"
        if (lines := _runtime_imports_of_testing(p))
    }
    assert not offenders, offenders
