"""``@ray_velo.transfer``: the wrappers that stage a Ray call's large payloads and resolve them
before the body runs (docs/transfer.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import ray

from ray_velo import _ray
from ray_velo.staging.resolution import Resolution, discard_tree, stage_tree
from ray_velo.staging.tree import TransferOptions

__all__ = [
    "TransferActorClass",
    "TransferActorHandle",
    "TransferFunction",
    "transfer",
]

_MARK = "__ray_velo_transfer__"  # a decorated method's options
_RAW = "__ray_velo_raw__"  # a decorated method's undecorated function


# --- the callee side --------------------------------------------------------------------------


def _callee(
    fn: Callable[..., Any], options: TransferOptions, *, retried_on_error: bool = False
) -> Callable[..., Any]:
    """The body Ray runs: resolve (claim) staged arguments, run, stage results, end claims.

    The claims are consumed after the body: on success always; on an exception only when Ray
    will not retry it (``retried_on_error`` False, Ray's default), so a retried task claims
    its arguments again and a failed one leaves nothing behind. A worker that crashes gives
    its claims back (its agent sees it die): Ray retries system failures.
    """
    if inspect.iscoroutinefunction(fn):
        return _async_callee(fn, options, retried_on_error)
    if inspect.isasyncgenfunction(fn):
        return _async_generator_callee(fn, options, retried_on_error)
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator_body(*args: Any, **kwargs: Any) -> Iterator[Any]:
            resolution = Resolution("claim")
            ok = False
            try:
                args, kwargs = resolution.tree((args, kwargs))
                for item in fn(*args, **kwargs):
                    if not options.stage_returns:
                        yield item
                        continue
                    staged = None
                    try:
                        staged = stage_tree(item, options, options.fetch_timeout)
                        yield staged
                    except BaseException:
                        _drop_unsent(staged)
                        raise
                ok = True
            finally:  # also a stream closed early
                resolution.end(consume=ok or not retried_on_error)

        return generator_body

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        resolution = Resolution("claim")
        ok = False
        try:
            # inside the try: arguments resolved before one that fails end their claims too
            args, kwargs = resolution.tree((args, kwargs))
            result = fn(*args, **kwargs)
            if options.stage_returns:
                result = stage_tree(result, options, options.fetch_timeout)
            ok = True
            return result
        finally:
            resolution.end(consume=ok or not retried_on_error)

    return body


def _async_callee(
    fn: Callable[..., Any], options: TransferOptions, retried_on_error: bool
) -> Callable[..., Any]:
    """:func:`_callee` for ``async def``: fetching and staging block on Ray calls, so they
    run in a worker thread and the actor's event loop keeps serving other calls."""

    @functools.wraps(fn)
    async def async_body(*args: Any, **kwargs: Any) -> Any:
        resolution = Resolution("claim")
        ok = False
        try:
            args, kwargs = await asyncio.to_thread(resolution.tree, (args, kwargs))
            result = await fn(*args, **kwargs)
            if options.stage_returns:
                result = await asyncio.to_thread(stage_tree, result, options, options.fetch_timeout)
            ok = True
            return result
        finally:
            resolution.end(consume=ok or not retried_on_error)

    return async_body


def _async_generator_callee(
    fn: Callable[..., Any], options: TransferOptions, retried_on_error: bool
) -> Callable[..., Any]:
    """:func:`_callee` for ``async def`` generators (streaming actor methods)."""

    @functools.wraps(fn)
    async def async_generator_body(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        resolution = Resolution("claim")
        ok = False
        try:
            args, kwargs = await asyncio.to_thread(resolution.tree, (args, kwargs))
            async for item in fn(*args, **kwargs):
                if not options.stage_returns:
                    yield item
                    continue
                staged = None
                try:
                    staged = await asyncio.to_thread(
                        stage_tree, item, options, options.fetch_timeout
                    )
                    yield staged
                except BaseException:
                    await asyncio.to_thread(_drop_unsent, staged)
                    raise
            ok = True
        finally:
            resolution.end(consume=ok or not retried_on_error)

    return async_generator_body


def _drop_unsent(staged: Any) -> None:
    """A streamed item staged but interrupted before Ray took it, or a stream closed at its
    yield (the runner ends a generator that way only when the stream is cancelled): nobody
    may ever hold its handles, so release them. A reader of a cancelled stream discards
    its items anyway; releasing one it already has is refused harmlessly."""
    if staged is not None:
        with contextlib.suppress(Exception):
            discard_tree(staged)


# --- the caller side ---------------------------------------------------------------------------


def _stage_call(args: tuple[Any, ...], kwargs: dict[str, Any], options: TransferOptions) -> Any:
    # An argument goes to exactly one callee: consumers=N is for results (fan-out), and an
    # argument staged with N references would keep N-1 of them until its TTL.
    single = dataclasses.replace(options, consumers=1)
    return stage_tree((args, kwargs), single, options.fetch_timeout)


class TransferFunction:
    """A ``@ray.remote`` function whose large arguments and results are staged."""

    def __init__(self, remote_function: Any, options: TransferOptions, *, _inner: Any = None):
        self._options = options
        self._source = remote_function
        raw, defaults = _ray.remote_function_parts(remote_function)
        if _inner is None:
            body = _callee(raw, options, retried_on_error=bool(defaults.get("retry_exceptions")))
            _inner = ray.remote(**defaults)(body) if defaults else ray.remote(body)
        self._inner = _inner
        self._name = raw.__qualname__
        functools.update_wrapper(self, raw)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _stage_call(args, kwargs, self._options)
        return self._inner.remote(*args, **kwargs)

    def options(self, **ray_options: Any) -> TransferFunction:
        if "retry_exceptions" in ray_options:
            # whether a failed body's arguments must survive for a retry is decided when
            # the body is built: rebuild it for the new option
            raw, source_options = _ray.remote_function_parts(self._source)
            source_options.update(ray_options)
            rebuilt = TransferFunction(ray.remote(**source_options)(raw), self._options)
            rebuilt._source = self._source
            return rebuilt
        return TransferFunction(
            self._source, self._options, _inner=self._inner.options(**ray_options)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"remote function {self._name} cannot be called directly: use .remote()")


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
            creation = _actor_options(actor_class)
            class_retries = bool(creation.get("max_task_retries"))
            for name, method_options in _inner_methods(user_class, options):
                self._methods[name] = method_options
                method = getattr(user_class, name)
                method = getattr(method, _RAW, method)  # decorated on its own too
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
        "(inside an actor class, @ray_velo.transfer(...) on a method stages that method's "
        "results and resolves its staged arguments; @ray_velo.transfer above the class's "
        "@ray.remote also stages the arguments its callers pass)"
    )


def _method(method: Callable[..., Any], options: TransferOptions) -> Callable[..., Any]:
    """A method decorated inside its class. Wrapped on its own, so that it also works in a
    plain ``@ray.remote`` class: its body resolves staged arguments and stages its results
    (callers' arguments are staged only through a decorated class's handles). A decorated
    class reads the options and wraps the undecorated function instead."""
    retried = bool(getattr(method, "__ray_retry_exceptions__", False)) and bool(
        getattr(method, "__ray_max_task_retries__", 0)
    )
    wrapped = _callee(method, options, retried_on_error=retried)
    setattr(wrapped, _MARK, options)
    setattr(wrapped, _RAW, method)
    return wrapped


def _apply(target: Any, options: TransferOptions) -> Any:
    if hasattr(target, "_function") and hasattr(target, "_default_options"):
        return TransferFunction(target, options)
    if hasattr(target, "__ray_actor_class__"):
        return TransferActorClass(target, options)
    if inspect.isfunction(target):
        parts = target.__qualname__.split(".")
        if len(parts) >= 2 and parts[-2] != "<locals>":
            return _method(target, options)
    raise _wrong_order(target)


def transfer(
    target: Any = None,
    *,
    threshold_bytes: int | None = None,
    consumers: int = 1,
    ttl: float | None = None,
    fetch_timeout: float | None = None,
    stage_returns: bool = True,
    lifetime: str | None = None,
) -> Any:
    """Stage large arguments and results of a ``@ray.remote`` function or actor class.

    Use bare (``@ray_velo.transfer``) or with options; it goes above ``@ray.remote``. On a
    method inside an actor class it sets that method's options, and works in a plain
    ``@ray.remote`` class too: the method resolves staged arguments and stages its results
    (arguments are staged at the caller only through a decorated class's handles). Async
    functions, async actor methods and async generators are supported (fetching and staging
    run off the event loop). The semantics: docs/transfer.md.

    What it stages ends with the Ray job that staged it (the caller's for arguments, the
    callee's for results); ``lifetime="detached"`` keeps it past that job until it is
    resolved, released or its ``ttl`` fires.

    Raises:
        TypeError: at decoration time, when placed below ``@ray.remote`` (the message shows
            the right order).
        ConfigError: an option breaks its rule.
    """
    options = TransferOptions(
        threshold_bytes, consumers, ttl, fetch_timeout, stage_returns, lifetime
    )
    if target is None:
        return lambda t: _apply(t, options)
    return _apply(target, options)
