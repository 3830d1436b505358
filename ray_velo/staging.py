"""``@ray_velo.transfer``: transparent staging of large arguments and results of Ray calls.

Stack it above ``@ray.remote`` on a function, a generator or an actor class::

    @ray_velo.transfer                       # or @ray_velo.transfer(threshold_bytes=..., ...)
    @ray.remote
    def step(batch: np.ndarray) -> np.ndarray: ...

Arguments and results above the threshold (256 KiB; numpy arrays, bytes-likes and CPU
tensors, also inside lists, tuples and dicts) are staged on the sender's node agent and
replaced by a :class:`StagedValue`; the receiver resolves every StagedValue before the
body runs, so the body sees plain values, never a handle. A result comes back to the caller
as a StagedValue: a decorated callee resolves it as an argument, and the driver resolves it
with :func:`resolve` (which takes ObjectRefs too). Payloads at or under the threshold travel
as plain Ray values.

Mapping of the spec's transparent staging onto Ray (DESIGN.md §5):

* ``_rv`` and ``_rv_budget_ms`` are the StagedValue's ``handle`` and ``budget_s``. They are
  taken out of the call before the body runs, so nothing the body forwards carries them.
* Single-use by default: a staged value has ``consumers`` references (1 unless fan-out asks
  for more), one consumed per successful resolution. The reference is dropped only after the
  body returned, so a Ray retry of a failed task resolves the same value again; what no
  retry consumes, the TTL frees (``ttl``, defaulting to ``fetch_timeout`` when that is set).
* ``fetch_timeout`` is the caller's budget; it travels with the value and bounds the
  receiver's fetch together with the agent-wide ``staged_fetch_timeout``.
* The receiver's ``staged_payload_max`` fails the task (or ends the stream) before anything
  of the payload's size is allocated, with both sizes in the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from ray_velo.errors import (
    ConfigError,
    HandleNotFound,
    HandleReleased,
    PayloadTooLarge,
    VeloError,
)
from ray_velo.payload import payload_nbytes
from ray_velo.protocol import DataHandle
from ray_velo.store import RELEASED_BY_CONSUMERS

__all__ = ["StagedValue", "TransferOptions", "resolve", "resolve_stream", "transfer"]

_MARK = "__ray_velo_transfer__"


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """Options of one decorated function, method or actor class.

    Attributes:
        threshold_bytes: payloads strictly above this are staged (bytes); None (the
            default) takes the cluster's ``VeloConfig.threshold_bytes`` (256 KiB).
        consumers: how many resolutions one staged value allows (fan-out).
        ttl: seconds after which a staged value is freed whatever happens; None: no TTL
            unless ``fetch_timeout`` is set, which then serves as the TTL.
        fetch_timeout: the caller's budget (s) for each receiver's fetch.
        stage_returns: stage large results (and yielded items) too.
    """

    threshold_bytes: int | None = None
    consumers: int = 1
    ttl: float | None = None
    fetch_timeout: float | None = None
    stage_returns: bool = True

    def __post_init__(self) -> None:
        if self.threshold_bytes is not None and (
            not isinstance(self.threshold_bytes, int) or self.threshold_bytes < 0
        ):
            raise ConfigError(
                field="threshold_bytes", value=self.threshold_bytes, rule="must be an int >= 0"
            )
        if not isinstance(self.consumers, int) or self.consumers < 1:
            raise ConfigError(field="consumers", value=self.consumers, rule="must be >= 1")
        for name in ("ttl", "fetch_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(field=name, value=value, rule="must be None or > 0 seconds")

    @property
    def effective_ttl(self) -> float | None:
        if self.ttl is not None:
            return self.ttl
        return self.fetch_timeout


@dataclass(frozen=True, slots=True)
class StagedValue:
    """A payload staged on its sender's node, travelling in place of the value.

    ``budget_s`` is the sender's ``fetch_timeout`` for this send (the spec's
    ``_rv_budget_ms``: a decorated call's budget starts when it is sent, so all of it is
    left); the receiver starts that bound when it resolves.
    """

    handle: DataHandle
    nbytes: int
    consumers: int = 1
    budget_s: float | None = None

    def __repr__(self) -> str:
        return f"StagedValue({self.handle}, {self.nbytes} bytes)"


# --- walking values ------------------------------------------------------------------------


def _stage_tree(value: Any, options: TransferOptions, budget_s: float | None) -> Any:
    """``value`` with every payload above the threshold staged and replaced."""
    from ray_velo import api

    if isinstance(value, StagedValue):
        return value
    nbytes = payload_nbytes(value)
    if nbytes is not None:
        threshold = options.threshold_bytes
        if threshold is None:
            threshold = api._process().config.threshold_bytes if nbytes > 0 else 0
        if nbytes <= threshold:
            return value
        handle = api._stage(
            value, pinned=True, ttl=options.effective_ttl, consumers=options.consumers
        )
        return StagedValue(handle, nbytes, options.consumers, budget_s)
    if isinstance(value, list):
        return [_stage_tree(v, options, budget_s) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_stage_tree(v, options, budget_s) for v in value)
    if isinstance(value, tuple):  # a namedtuple keeps its type
        return type(value)(*(_stage_tree(v, options, budget_s) for v in value))
    if isinstance(value, dict):
        return {k: _stage_tree(v, options, budget_s) for k, v in value.items()}
    return value


def _resolve_one(staged: StagedValue, consume: bool, held: list[DataHandle]) -> Any:
    from ray_velo import api

    try:
        value = api.fetch(staged.handle, release=consume, timeout=staged.budget_s)
    except PayloadTooLarge:
        if not consume:  # refused for good: release it so its owner frees the staged copy
            with contextlib.suppress(VeloError):
                api.release(staged.handle, 0)
        raise
    except HandleNotFound as exc:
        if exc.fields.get("reason") == RELEASED_BY_CONSUMERS:
            raise HandleReleased(
                handle=str(staged.handle),
                allowed=staged.consumers,
                option=f"consumers=N (it was staged with consumers={staged.consumers})",
            ) from exc
        raise
    if not consume:
        held.append(staged.handle)
    return value


def _resolve_tree(value: Any, consume: bool, held: list[DataHandle]) -> Any:
    if isinstance(value, StagedValue):
        return _resolve_one(value, consume, held)
    if isinstance(value, list):
        return [_resolve_tree(v, consume, held) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_resolve_tree(v, consume, held) for v in value)
    if isinstance(value, tuple):
        return type(value)(*(_resolve_tree(v, consume, held) for v in value))
    if isinstance(value, dict):
        return {k: _resolve_tree(v, consume, held) for k, v in value.items()}
    return value


def _drop_references(held: list[DataHandle]) -> None:
    """The body succeeded: consume the reference of each value it resolved."""
    from ray_velo import api

    for handle in held:  # not waited for: a TTL that came first is no error here
        api._release_soon(handle)


def resolve(value: Any, *, timeout: float | None = None) -> Any:
    """A call's result with every staged payload fetched (for the driver or any undecorated
    code). Accepts an ObjectRef, a list of them, or an already-fetched value.

    Raises:
        HandleReleased: a staged value was resolved more times than its ``consumers``.
        TransferTimeout, OwnerDied, PayloadTooLarge: as for :func:`ray_velo.fetch`.
    """
    if isinstance(value, ray.ObjectRef) or (
        isinstance(value, list) and value and all(isinstance(v, ray.ObjectRef) for v in value)
    ):
        value = ray.get(value, timeout=timeout)
    return _resolve_tree(value, True, [])


def _discard_tree(value: Any) -> None:
    """Release every staged value in ``value`` unread (a stream that ended early)."""
    from ray_velo import api

    if isinstance(value, StagedValue):
        for _ in range(value.consumers):
            try:
                api.release(value.handle, 0)
            except HandleNotFound:
                break
    elif isinstance(value, (list, tuple)):
        for item in value:
            _discard_tree(item)
    elif isinstance(value, dict):
        for item in value.values():
            _discard_tree(item)


def resolve_stream(refs: Any, *, timeout: float | None = None) -> Iterator[Any]:
    """Iterate a streaming generator's ObjectRefs, each item resolved as it arrives.

    If an item fails (over this node's ``staged_payload_max``, timed out, owner gone), the
    stream ends with that error: the producer is cancelled and the items it already staged
    are released unread, so nothing stays behind. Other streams are not affected.
    """
    try:
        for ref in refs:
            yield resolve(ref, timeout=timeout)
    except BaseException:
        ray.cancel(refs)
        try:
            for ref in refs:
                _discard_tree(ray.get(ref, timeout=30))
        except Exception:  # the cancelled producer ends the stream with its own error
            pass
        raise


# --- the callee side --------------------------------------------------------------------------


def _budget(options: TransferOptions) -> float | None:
    return options.fetch_timeout


def _callee(
    fn: Callable[..., Any], options: TransferOptions, *, retried_on_error: bool = False
) -> Callable[..., Any]:
    """The body Ray runs: resolve staged arguments, run, stage results, then consume.

    The arguments' references are consumed after the body: on success always; on an
    exception only when Ray will not retry it (``retried_on_error`` False, Ray's default),
    so a retried task finds its arguments again and a failed one leaves nothing behind.
    A worker that crashes consumes nothing: Ray retries system failures.
    """
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"@ray_velo.transfer does not support async {fn.__qualname__} yet; use a sync "
            "function or actor method"
        )
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator_body(*args: Any, **kwargs: Any) -> Iterator[Any]:
            held: list[DataHandle] = []
            ok = False
            try:
                args, kwargs = _resolve_tree((args, kwargs), False, held)
                for item in fn(*args, **kwargs):
                    yield (
                        _stage_tree(item, options, _budget(options))
                        if options.stage_returns
                        else item
                    )
                ok = True
            finally:
                if ok or not retried_on_error:  # also a stream closed early
                    _drop_references(held)

        return generator_body

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        held: list[DataHandle] = []
        ok = False
        try:
            # inside the try: arguments resolved before one that fails are consumed too
            args, kwargs = _resolve_tree((args, kwargs), False, held)
            result = fn(*args, **kwargs)
            if options.stage_returns:
                result = _stage_tree(result, options, _budget(options))
            ok = True
            return result
        finally:
            if ok or not retried_on_error:
                _drop_references(held)

    return body


# --- the caller side ---------------------------------------------------------------------------


def _stage_call(args: tuple[Any, ...], kwargs: dict[str, Any], options: TransferOptions) -> Any:
    # An argument goes to exactly one callee: consumers=N is for results (fan-out), and an
    # argument staged with N references would keep N-1 of them until its TTL.
    single = dataclasses.replace(options, consumers=1)
    return _stage_tree((args, kwargs), single, _budget(options))


class TransferFunction:
    """A ``@ray.remote`` function whose large arguments and results are staged."""

    def __init__(self, remote_function: Any, options: TransferOptions, *, _inner: Any = None):
        self._options = options
        self._source = remote_function
        if _inner is None:
            raw = remote_function._function
            defaults = dict(remote_function._default_options)
            body = _callee(raw, options, retried_on_error=bool(defaults.get("retry_exceptions")))
            _inner = ray.remote(**defaults)(body) if defaults else ray.remote(body)
        self._inner = _inner
        functools.update_wrapper(self, remote_function._function)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _stage_call(args, kwargs, self._options)
        return self._inner.remote(*args, **kwargs)

    def options(self, **ray_options: Any) -> TransferFunction:
        if "retry_exceptions" in ray_options:
            # whether a failed body's arguments must survive for a retry is decided when
            # the body is built: rebuild it for the new option
            source_options = dict(self._source._default_options)
            source_options.update(ray_options)
            rebuilt = TransferFunction(
                ray.remote(**source_options)(self._source._function), self._options
            )
            rebuilt._source = self._source
            return rebuilt
        return TransferFunction(
            self._source, self._options, _inner=self._inner.options(**ray_options)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"remote function {self._source._function.__qualname__} cannot be called "
            "directly: use .remote()"
        )


class _TransferActorMethod:
    def __init__(self, method: Any, options: TransferOptions) -> None:
        self._method, self._options = method, options

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _stage_call(args, kwargs, self._options)
        return self._method.remote(*args, **kwargs)

    def options(self, **ray_options: Any) -> _TransferActorMethod:
        return _TransferActorMethod(self._method.options(**ray_options), self._options)


class TransferActorHandle:
    """An actor handle whose method calls stage large arguments. Picklable: it travels to
    other tasks as a handle that still stages."""

    def __init__(self, handle: Any, options: TransferOptions, methods: dict[str, Any]):
        self._handle, self._options, self._methods = handle, options, methods

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        options = self._methods.get(name)
        if options is None:  # not wrapped on the actor (a static method): nothing to stage
            return method
        return _TransferActorMethod(method, options)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TransferActorHandle, (self._handle, self._options, self._methods))

    @property
    def ray_handle(self) -> Any:
        """The plain Ray actor handle (for ray.kill and the like)."""
        return self._handle


class TransferActorClass:
    """A ``@ray.remote`` actor class whose methods stage large arguments and results."""

    def __init__(self, actor_class: Any, options: TransferOptions, *, _inner: Any = None):
        self._options = options
        self._source = actor_class
        user_class = actor_class.__ray_actor_class__
        self._methods: dict[str, TransferOptions] = {}
        if _inner is None:
            namespace: dict[str, Any] = {}
            class_retries = bool(_actor_options(actor_class).get("max_task_retries"))
            for name, method_options in _inner_methods(user_class, options):
                self._methods[name] = method_options
                method = getattr(user_class, name)
                # @ray.method(retry_exceptions=...) (or the class's) marks a method whose
                # failed calls Ray retries: its arguments must outlive a failed attempt.
                retried = bool(getattr(method, "__ray_retry_exceptions__", False)) and (
                    class_retries or bool(getattr(method, "__ray_max_task_retries__", 0))
                )
                wrapped = _callee(method, method_options, retried_on_error=retried)
                for attribute in ("__ray_retry_exceptions__", "__ray_max_task_retries__"):
                    if hasattr(method, attribute):
                        setattr(wrapped, attribute, getattr(method, attribute))
                namespace[name] = wrapped
            staged_class = type(user_class.__name__, (user_class,), namespace)
            staged_class.__qualname__ = user_class.__qualname__
            staged_class.__module__ = user_class.__module__
            creation = _actor_options(actor_class)
            _inner = ray.remote(**creation)(staged_class) if creation else ray.remote(staged_class)
        else:
            self._methods = dict(_inner_methods(user_class, options))
        self._inner = _inner

    def remote(self, *args: Any, **kwargs: Any) -> TransferActorHandle:
        args, kwargs = _stage_call(args, kwargs, self._options)
        return TransferActorHandle(
            self._inner.remote(*args, **kwargs), self._options, self._methods
        )

    def options(self, **ray_options: Any) -> TransferActorClass:
        return TransferActorClass(
            self._source, self._options, _inner=self._inner.options(**ray_options)
        )


def _inner_methods(user_class: type, options: TransferOptions) -> Iterator[tuple[str, Any]]:
    """The actor methods transfer wraps, with their options: instance methods (and
    ``__init__``), not static or class methods, which Ray does not call on the instance."""
    for name, member in inspect.getmembers(user_class, inspect.isfunction):
        if name.startswith("__") and name != "__init__":
            continue
        if isinstance(inspect.getattr_static(user_class, name), (staticmethod, classmethod)):
            continue
        yield name, getattr(member, _MARK, options)


def _actor_options(actor_class: Any) -> dict[str, Any]:
    meta = actor_class.__ray_metadata__
    out: dict[str, Any] = {}
    for name in (
        "num_cpus",
        "num_gpus",
        "memory",
        "resources",
        "max_restarts",
        "max_task_retries",
        "runtime_env",
        "scheduling_strategy",
        "accelerator_type",
    ):
        value = getattr(meta, name, None)
        if value is not None and value != {}:
            out[name] = value
    concurrency = getattr(actor_class, "_default_options", {}) or {}
    for key in ("max_concurrency", "lifetime", "name", "namespace"):
        if key in concurrency:
            out[key] = concurrency[key]
    return out


def _wrong_order(target: Any) -> TypeError:
    kind = "class" if inspect.isclass(target) else "function"
    name = getattr(target, "__qualname__", repr(target))
    return TypeError(
        f"@ray_velo.transfer must sit above @ray.remote ({kind} {name}):\n"
        "    @ray_velo.transfer\n    @ray.remote\n    def f(...): ...\n"
        "(inside an actor class, @ray_velo.transfer(...) on a method only sets that method's "
        "options; the class itself still needs @ray_velo.transfer above @ray.remote)"
    )


def _apply(target: Any, options: TransferOptions) -> Any:
    if hasattr(target, "_function") and hasattr(target, "_default_options"):
        return TransferFunction(target, options)
    if hasattr(target, "__ray_actor_class__"):
        return TransferActorClass(target, options)
    if inspect.isfunction(target):
        parts = target.__qualname__.split(".")
        if len(parts) >= 2 and parts[-2] != "<locals>":
            setattr(target, _MARK, options)  # a method: its class's decorator reads this
            return target
    raise _wrong_order(target)


def transfer(
    target: Any = None,
    *,
    threshold_bytes: int | None = None,
    consumers: int = 1,
    ttl: float | None = None,
    fetch_timeout: float | None = None,
    stage_returns: bool = True,
) -> Any:
    """Stage large arguments and results of a ``@ray.remote`` function or actor class.

    Use bare (``@ray_velo.transfer``) or with options; it goes above ``@ray.remote``. On a
    method inside an actor class it sets that method's options (the class needs the
    decorator too). See the module docstring for the semantics.

    Raises:
        TypeError: at decoration time, when placed below ``@ray.remote`` (the message shows
            the right order).
        ConfigError: an option breaks its rule.
    """
    options = TransferOptions(threshold_bytes, consumers, ttl, fetch_timeout, stage_returns)
    if target is None:
        return lambda t: _apply(t, options)
    return _apply(target, options)
