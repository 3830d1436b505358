"""Ray's internals behind one module (ray_velo/_ray.py): no other module of the library
imports or reaches anything of Ray's that is not public API, and each reach in that module
says which Ray versions it was checked on."""

from __future__ import annotations

import ast
import pathlib

import ray_velo
from ray_velo import _ray

ROOT = pathlib.Path(ray_velo.__file__).parent
#: Modules of Ray that are not its public API.
PRIVATE_MODULES = ("ray._private", "ray._raylet", "ray._common", "ray.experimental.internal_kv",
                   "ray.experimental.rdt", "ray.experimental.gpu_object_manager")  # fmt: skip
#: Names of Ray's that are not public API, imported or reached as attributes.
PRIVATE_NAMES = {
    "internal_kv", "TensorTransportManager", "TensorTransportMetadata",
    "register_tensor_transport", "_private", "_raylet", "global_worker", "_function",
    "_default_options", "_record", "_ray_enable_tensor_transport", "_thread_local",
    "_rdt_custom_serializer_registered", "_zero_copy_tensors_enabled",
    "_internal_kv_put", "_internal_kv_get", "_internal_kv_del", "_internal_kv_exists",
}  # fmt: skip


def library_files() -> list[pathlib.Path]:
    files = [p for p in ROOT.rglob("*.py") if p.name != "_ray.py"]
    files += [p for p in (ROOT / "actors").resolve().rglob("*.py")]  # the actors/ symlink
    return sorted(set(files))


def reaches(path: pathlib.Path) -> list[str]:
    """Every import of a private Ray module, and every private Ray name a module reaches."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(PRIVATE_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray"):
            module = node.module or ""
            if module.startswith(PRIVATE_MODULES):
                found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if a.name in PRIVATE_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_module_but_ray_boundary_reaches_rays_internals() -> None:
    """ray_velo/_ray.py is the only module that imports ray._private, ray._raylet,
    internal_kv or Ray's RDT internals, or touches a private attribute of Ray's objects."""
    offenders = {str(p.relative_to(ROOT.parent)): r for p in library_files() if (r := reaches(p))}
    assert not offenders, offenders
    assert reaches(ROOT / "_ray.py"), "the boundary module itself must be what reaches them"


def test_every_reach_says_the_versions_it_was_checked_on() -> None:
    """Each public function of the boundary documents the Ray versions it was checked on (or
    is a plain helper of the others)."""
    helpers = {"version_text", "has_tensor_transport", "kv_get", "kv_delete", "kv_exists"}
    for name in _ray.__all__:
        value = getattr(_ray, name)
        if not callable(value) or name in helpers or isinstance(value, type):
            continue
        assert "checked" in (value.__doc__ or ""), f"_ray.{name} does not say where it was checked"
    assert _ray.CHECKED_VERSIONS[0] == "2.40.0"
