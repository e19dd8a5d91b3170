"""In-process checks of the HTTP app's plumbing (no model): long-poll timeout, failure shape, auth mapping."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.core.operations import OperationBook
from together_train_server.wire.http.tinker import futures as tinker_futures
from together_train_server.wire.http.app import create_app, owner_for


class _Resource:
    """Just what retrieve_future calls (``submissions``' get_operation and wait_operation over an operation book)
    and what the Tinker routes' install reads (``client_heartbeat_timeout_s``; 0: no heartbeat watch)."""

    def __init__(self) -> None:
        self.book = OperationBook()
        self.client_heartbeat_timeout_s = 0.0
        self.submissions = self  # the operations part (`SubmissionsApi`) is this object

    def get_operation(self, op_id: str, owner: str = ""):
        return self.book.get(op_id)

    def max_request_bytes(self) -> int:
        return 8 << 20

    def wait_operation(self, op_id: str, timeout_s: float, owner: str = "", **_):
        return self.book.wait(op_id, timeout_s)


def test_retrieve_future_long_polls_then_408_then_result(monkeypatch):
    monkeypatch.setattr(tinker_futures, "LONG_POLL_S", 0.3)
    resource = _Resource()
    release = threading.Event()
    rec = resource.book.run_detached("", "tinker_create_model", lambda: (release.wait(), {"model_id": "m"})[1])
    client = TestClient(create_app(resource, None, modules=["together_train_server.wire.http.tinker"]))
    r = client.post("/api/v1/retrieve_future", json={"request_id": rec.operation_id})
    assert r.status_code == 408 and r.json()["type"] == "try_again"
    release.set()
    r = client.post("/api/v1/retrieve_future", json={"request_id": rec.operation_id})
    assert r.status_code == 200 and r.json() == {"model_id": "m"}


@pytest.mark.parametrize("err, category", [(invalid("bad weights", sample_index=1, key="weights"), "user"),
                                           (ServiceError("INTERNAL", "engine broke"), "server")])
def test_failed_operation_is_200_error_with_category(err, category):
    resource = _Resource()

    def fail():
        raise err

    rec = resource.book.run_detached("", "x", fail)
    client = TestClient(create_app(resource, None, modules=["together_train_server.wire.http.tinker"]))
    body = client.post("/api/v1/retrieve_future", json={"request_id": rec.operation_id}).json()
    assert body == {"error": str(err), "category": category}
    assert client.post("/api/v1/retrieve_future", json={"request_id": "op-unknown"}).status_code == 404


def test_owner_for_maps_tml_keys_onto_ours():
    keys = frozenset({"abc", "tml-literal"})
    assert owner_for("tml-abc", keys) == "abc"  # the tinker SDK's form of key "abc"
    assert owner_for("abc", keys) == "abc"
    assert owner_for("tml-literal", keys) == "tml-literal"
    assert owner_for("tml-nope", keys) is None and owner_for(None, keys) is None
    assert owner_for("anything", None) == ""
