"""``held_elsewhere``: a SendBuffer is sealed without a copy only when nothing but its own
name reaches the array's memory. Every way a caller can keep that memory must be seen, or
a write after seal would change bytes a reader is GETting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ray_velo.client.writable import held_elsewhere, typed_array


class _Exporter:
    """Flat uint8 memory exported like a reservation's (``__array_interface__``)."""

    __slots__ = ("__array_interface__", "__weakref__", "_memory")

    def __init__(self, nbytes: int) -> None:
        self._memory = np.zeros(nbytes, dtype=np.uint8)
        self.__array_interface__ = {
            "data": (self._memory.ctypes.data, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _array() -> np.ndarray[Any, Any]:
    return typed_array(_Exporter(4096), np.dtype(np.float32), (32, 32))


def _torch_tensor(a: np.ndarray[Any, Any]) -> Any:
    torch = pytest.importorskip("torch")
    return torch.from_numpy(a)


KEEPERS: dict[str, Callable[[np.ndarray[Any, Any]], Any]] = {
    "another name": lambda a: a,
    "a slice": lambda a: a[1:],
    "a view of a view": lambda a: a[1:][::2, 3:],
    "a reshape": lambda a: a.reshape(-1),
    "a dtype view": lambda a: a.view(np.uint8),
    "a transpose": lambda a: a.T,
    "a memoryview": memoryview,
    "the .data memoryview": lambda a: a.data,
    "np.frombuffer": lambda a: np.frombuffer(a, dtype=np.uint8),
    "the ctypes object": lambda a: a.ctypes,
    "its base": lambda a: a.base,
    "the exporter": lambda a: a.base.base,
    "a list holding it": lambda a: [a],
    "a torch tensor": _torch_tensor,
}


def test_the_buffers_own_name_alone_is_not_held_elsewhere() -> None:
    array = _array()
    array[:] = 1.5  # writing through the name keeps nothing
    np.add(array, 1, out=array)
    assert not held_elsewhere(array)


@pytest.mark.parametrize("keeper", sorted(KEEPERS))
def test_every_reference_to_the_memory_is_seen_until_it_goes(keeper: str) -> None:
    array = _array()
    kept = KEEPERS[keeper](array)
    assert held_elsewhere(array), f"{keeper} was not seen"
    del kept
    assert not held_elsewhere(array), f"{keeper} was still seen after it went"


def test_an_array_over_plain_numpy_memory_is_judged_the_same() -> None:
    """A zero-size SendBuffer holds a plain array (no exporter): the same rules."""
    array = np.empty((0, 3))
    assert not held_elsewhere(array)
    view = array[:]
    assert held_elsewhere(array)
    del view
    assert not held_elsewhere(array)


def test_this_interpreter_counts_references_as_the_check_expects() -> None:
    """Else every seal copies (safe, slow): a new CPython that counts differently must show
    up here, not as a silent loss of the zero-copy path."""
    from ray_velo.client import writable

    assert writable._counts_as_expected()


def test_an_interpreter_whose_counts_cannot_be_read_makes_every_seal_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray_velo.client import writable

    monkeypatch.setattr(writable, "_counts_as_expected", lambda: False)
    array = _array()
    assert held_elsewhere(array)
