"""An unexpected engine error is traceable: the client's INTERNAL message carries an error id
under which the server logs the traceback with the session and operation ids.

The server runs with the test-only fault injection hook
(``TOGETHER_TRAIN_TEST_FAULTS``, ``together_train_server.engines.fault_injection``):
its first ``optim_step`` (run by the trainer worker, an operation) and its
second ``create_adapter`` (run inside the CreateSession RPC) raise an ordinary
RuntimeError. The log read is the real server process's stderr.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import together_train as tt
from together_train import errors

VOCAB = 49152
ERROR_ID = re.compile(r"internal error (err-[0-9a-f]{12}) in (\w+)")


def good_batch() -> list[tt.Sample]:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, size=(2, 11))
    return [
        tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(10, np.float32)})
        for t in toks
    ]


@pytest.fixture(scope="module")
def faulty(tiny_model_dir, tmp_path_factory):
    """(client, log path) of a resource whose engine fails on purpose."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=tmp_path_factory.mktemp("storage"),
        extra_args=["--trainer-threads", "1", "--generator-threads", "1"],
        log_file=log,
        env={"TOGETHER_TRAIN_TEST_FAULTS": "optim_step:1,create_adapter:2"},
    ) as client:
        yield client, log


def log_record(log_text: str, error_id: str) -> str:
    """The log lines from the one naming ``error_id`` up to the next log record (its traceback)."""
    start = log_text.index(error_id)
    start = log_text.rfind("\n", 0, start) + 1
    nxt = re.search(r"\n\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", log_text[start + 1:])
    return log_text[start: start + 1 + nxt.start()] if nxt else log_text[start:]


def test_operation_internal_error_is_logged_under_the_id_the_client_gets(faulty):
    client, log = faulty
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))  # create_adapter call 1
    try:
        s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
        fut = s.optim_step(tt.AdamParams(learning_rate=1e-3))
        with pytest.raises(errors.InternalError) as info:
            fut.result(timeout=120)
        msg = str(info.value)
        m = ERROR_ID.search(msg)
        assert m, msg
        error_id, where = m.groups()
        assert where == "optim_step" and "InjectedFault" in msg
        record = log_record(log.read_text(), error_id)
        assert "ERROR" in record.splitlines()[0]
        assert f"session {s.session_id}" in record and f"operation {fut.operation_id}" in record
        assert "Traceback (most recent call last)" in record
        assert "fault_injection.py" in record and "InjectedFault: injected test fault in optim_step" in record
        # The failed step changed nothing: the next one is step 1 on the same accumulated gradient.
        out = s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120)
        assert out.step == 1 and out.grad_norm > 0
    finally:
        s.stop()


def test_rpc_internal_error_is_logged_under_the_id_the_client_gets(faulty):
    client, log = faulty
    before = {x.session_id for x in client.list_sessions() if x.state == "active"}
    with pytest.raises(errors.InternalError) as info:
        client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))  # create_adapter call 2
    m = ERROR_ID.search(str(info.value))
    assert m, str(info.value)
    error_id, where = m.groups()
    assert where == "CreateSession"
    record = log_record(log.read_text(), error_id)
    assert "Traceback (most recent call last)" in record and "injected test fault in create_adapter" in record
    # no half-made session is left, and the next create works
    assert {x.session_id for x in client.list_sessions() if x.state == "active"} == before
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    s.stop()


def test_error_ids_are_unique_per_failure(faulty):
    _, log = faulty
    ids = re.findall(r"internal error (err-[0-9a-f]{12}) in", log.read_text())
    assert len(ids) >= 2 and len(set(ids)) == len(ids)
