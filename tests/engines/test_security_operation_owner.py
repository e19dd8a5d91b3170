"""Operations belong to the API key of their session, like sessions and checkpoints.

GetOperation / WaitOperation / CancelOperation looked records up
by id only once, so a caller with another API key could read the results (loss,
logprobs) of someone else's operation or cancel it.
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture()
def inproc_resource(tiny_model_dir, tmp_path):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.resource import Resource

    res = Resource(TorchTrainerEngine(tiny_model_dir), ReplicaPool([]), tmp_path / "storage")
    try:
        yield res
    finally:
        res.close()


def test_operations_of_another_key_are_not_found(inproc_resource):
    from together_train_server.engines.types import LoraConfig
    from together_train_server.service.errors import ServiceError

    res = inproc_resource
    s = res.sessions.create_session(LoraConfig(rank=2, alpha=4.0), owner="key-one")
    toks = np.arange(1, 6, dtype=np.int64)
    rec = res.submissions.submit_forward(
        s.session_id,
        0,
        "k0",
        samples=[(toks, {"target_tokens": toks + 1, "weights": np.ones(5, np.float32)})],
        loss_fn="cross_entropy",
        loss_params={},
        backward=False,
        return_logprobs=False,
        return_elementwise=False,
        owner="key-one",
    )
    for call in (
        lambda: res.submissions.get_operation(rec.operation_id, "key-two"),
        lambda: res.submissions.wait_operation(rec.operation_id, 1.0, "key-two"),
        lambda: res.submissions.cancel_operation(rec.operation_id, "key-two"),
        lambda: res.submissions.get_operation(rec.operation_id),  # no key at all
    ):
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.code == "NOT_FOUND"
        assert info.value.key == "operation_id"
    done = res.submissions.wait_operation(rec.operation_id, 30.0, "key-one")
    assert done.status == "SUCCEEDED"
    assert res.submissions.get_operation(rec.operation_id, "key-one") is done
