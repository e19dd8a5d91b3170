"""The ``*_async`` twin of every call that returns an `OperationFuture`, made in one place.

Mark a method with `returns_future`; the class decorator `with_async_twins`
adds ``<name>_async``: a coroutine function that calls the method and awaits
its future. The twin is derived, never written by hand, so its parameters,
defaults and docstring are the method's; only the return annotation differs
(``OperationFuture[X]`` becomes ``X``). ``inspect.signature`` and ``help()``
show exactly that.

The submission inside the twin runs synchronously before the first ``await``,
so coroutines started in order submit in order.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, TypeVar

__all__ = ["returns_future", "with_async_twins", "ASYNC_SUFFIX"]

ASYNC_SUFFIX = "_async"
_MARK = "__together_train_async_twin__"
_FUTURE_OF = re.compile(r"^\s*OperationFuture\[(?P<inner>.+)\]\s*$")

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def returns_future(method: F) -> F:
    """Mark `method` (which returns an `OperationFuture`) to get an ``*_async`` twin."""
    setattr(method, _MARK, True)
    return method


def _awaited(annotation: Any) -> Any:
    """``"OperationFuture[X]"`` -> ``"X"``; a bare ``OperationFuture`` -> ``Any``."""
    if isinstance(annotation, str):
        m = _FUTURE_OF.match(annotation)
        if m:
            return m.group("inner")
        return "Any" if annotation.strip() == "OperationFuture" else annotation
    return annotation


def make_async_twin(method: Callable[..., Any]) -> Callable[..., Any]:
    """The coroutine function ``<name>_async`` for `method`: call it, await its future.

    The twin carries `method`'s signature (return annotation: what the future
    resolves to), docstring (after a line saying what the twin does) and, as
    ``__wrapped__``, the method itself (so `typing.get_type_hints` resolves
    names in the method's module).
    """
    name = method.__name__

    async def twin(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await method(self, *args, **kwargs)

    functools.update_wrapper(twin, method)
    sig = inspect.signature(method)
    ret = _awaited(sig.return_annotation)
    twin.__signature__ = sig.replace(return_annotation=ret)  # type: ignore[attr-defined]
    twin.__annotations__ = {**getattr(method, "__annotations__", {}), "return": ret}
    twin.__name__ = name + ASYNC_SUFFIX
    twin.__qualname__ = method.__qualname__ + ASYNC_SUFFIX
    doc = inspect.getdoc(method) or ""
    twin.__doc__ = f"Coroutine: `{name}` and await its result.\n\n{doc}".rstrip()
    return twin


def with_async_twins(cls: C) -> C:
    """Class decorator: add ``<name>_async`` for each method marked `returns_future`.

    Raises:
        TypeError: when the class already defines a ``<name>_async`` by hand.
    """
    for name, member in list(vars(cls).items()):
        if callable(member) and getattr(member, _MARK, False):
            twin_name = name + ASYNC_SUFFIX
            if twin_name in vars(cls):
                raise TypeError(f"{cls.__name__}.{twin_name} is written by hand; the twin is derived from {name}")
            setattr(cls, twin_name, make_async_twin(member))
    return cls
