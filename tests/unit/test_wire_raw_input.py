"""Raw-wire input that bypasses the SDK's client-side checks is refused by the server, naming what is wrong."""

from __future__ import annotations

import pytest

from together_train._proto import common_pb2
from together_train.tensors import from_tensor


@pytest.mark.parametrize(
    "shape, data, words",
    [
        ([-1, -3], b"\0" * 12, "negative dimension"),
        ([-2, -2], b"\0" * 16, "negative dimension"),
        # 2**32 * 2**32 * 8 bytes wraps to 0 in int64 arithmetic: must not pass the size check
        ([2**32, 2**32], b"", "needs 147573952589676412928"),
    ],
)
def test_from_tensor_refuses_negative_or_overflowing_shapes(shape, data, words):
    t = common_pb2.Tensor(dtype=common_pb2.INT64, shape=shape, data=data)
    with pytest.raises(ValueError, match=words):
        from_tensor(t)


def test_negative_seq_id_is_invalid_argument_not_already_used():
    from together_train_server.service.errors import ServiceError
    from together_train_server.service.core.operations import OperationBook, SessionQueue

    class Worker:
        def enqueue(self, rec):
            pass

    q = SessionQueue("s-x", OperationBook(), Worker())
    with pytest.raises(ServiceError) as info:
        q.submit(-1, "k", "forward", None)
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.key == "seq_id"
    assert "already used" not in info.value.message
    assert q.submit(0, "k2", "forward", None).seq_id == 0  # the session's order is untouched
