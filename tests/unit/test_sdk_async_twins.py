"""Every call returning an OperationFuture has an ``*_async`` twin made by one mechanism (together_train._async):
same parameters and docstring as the call, a coroutine, returning what the future resolves to."""

from __future__ import annotations

import inspect
import typing

import pytest

import together_train as tt
from together_train import _async
from together_train.futures import OperationFuture

SESSION_CALLS = ("forward", "forward_backward", "custom_forward_backward", "optim_step", "weights_sync",
                 "save_weights", "save_state", "load_state", "load_state_with_optimizer", "sample",
                 "compute_logprobs")
CLIENT_CALLS = ("sample", "compute_logprobs")
PAIRS = [(tt.Session, n) for n in SESSION_CALLS] + [(tt.ResourceClient, n) for n in CLIENT_CALLS]


@pytest.mark.parametrize("cls,name", PAIRS, ids=[f"{c.__name__}.{n}" for c, n in PAIRS])
def test_twin_has_the_calls_signature_and_docstring(cls, name):
    sync, twin = getattr(cls, name), getattr(cls, name + "_async")
    assert inspect.iscoroutinefunction(twin), f"{cls.__name__}.{name}_async is not a coroutine function"
    s_sig, t_sig = inspect.signature(sync), inspect.signature(twin)
    assert list(t_sig.parameters.values()) == list(s_sig.parameters.values()), (s_sig, t_sig)
    assert s_sig.return_annotation.startswith("OperationFuture["), s_sig.return_annotation
    assert t_sig.return_annotation == s_sig.return_annotation[len("OperationFuture["):-1], (s_sig, t_sig)
    assert twin.__name__ == name + "_async" and twin.__qualname__ == f"{cls.__name__}.{name}_async"
    assert inspect.getdoc(sync) in inspect.getdoc(twin)
    assert f"`{name}` and await its result" in inspect.getdoc(twin)
    assert twin.__wrapped__ is sync  # derived from the call, not a copy
    hints = typing.get_type_hints(twin)  # names resolve in the call's module
    assert hints["return"] is typing.get_type_hints(sync)["return"].__args__[0]
    assert not any(line.strip().startswith(f"async def {name}_async") for line in inspect.getsource(cls).splitlines())


def test_every_future_returning_public_call_has_a_twin():
    for cls in (tt.Session, tt.ResourceClient):
        for name, member in vars(cls).items():
            if name.startswith("_") or not inspect.isfunction(member) or name.endswith("_async"):
                continue
            ret = inspect.signature(member).return_annotation
            if isinstance(ret, str) and ret.startswith("OperationFuture["):
                assert hasattr(cls, name + "_async"), f"{cls.__name__}.{name} returns a future but has no twin"


def test_hand_written_twin_is_refused():
    class Fake:
        @_async.returns_future
        def go(self, x: int) -> OperationFuture[int]:
            """Go."""

        async def go_async(self, x: int) -> int:
            return x

    with pytest.raises(TypeError, match="Fake.go_async is written by hand"):
        _async.with_async_twins(Fake)


def test_twin_awaits_the_future():
    import asyncio
    import concurrent.futures as cf

    @_async.with_async_twins
    class Calls:
        @_async.returns_future
        def double(self, x: int, *, plus: int = 0) -> OperationFuture[int]:
            """Twice x plus `plus`."""
            inner: cf.Future = cf.Future()
            inner.set_result(2 * x + plus)
            return OperationFuture(inner, kind="double")

    assert asyncio.run(Calls().double_async(3, plus=1)) == 7
    assert str(inspect.signature(Calls.double_async)) == "(self, x: 'int', *, plus: 'int' = 0) -> 'int'"
