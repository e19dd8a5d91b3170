"""Every RPC and HTTP route checks in one order: credentials, the session exists and belongs to the
caller, the session is usable, and only then the payload.

Each call below carries a bad payload (an empty batch, a bad name, an unknown mode, ...) and names
a session that is unknown, stopped, or another API key's. The answer must be about the session:
NOT_FOUND naming ``session_id`` (the same message for an unknown id and another key's, so a
cross-key call learns nothing, whatever the payload), FAILED_PRECONDITION for a stopped one; a call
without a key is UNAUTHENTICATED. Before, the payload was checked first: ``CustomForwardBackward``
with an empty batch answered INVALID_ARGUMENT 'the batch is empty' in all three cases.

A real resource (two API keys, HTTP on) on the tiny model; raw gRPC stubs and raw HTTP so the bad
payloads reach the server as sent (the SDKs refuse some of them first).
"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

import together_train as tt
from together_train._proto import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    resource_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)

KEY_A, KEY_B = "key-order-a", "key-order-b"
UNKNOWN = "s-0123456789abcdef"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    storage = tmp_path_factory.mktemp("storage")
    # The later --api-key-file (both keys) wins over the launcher's own (key A only).
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=storage, api_key=KEY_A, http_port=0,
                         extra_args=["--api-key-file", str(keys), "--generator-threads", "1",
                                     "--trainer-threads", "1"]) as client:
        live = client.create_session(lora=tt.LoraConfig(rank=2, alpha=4.0, seed=0))
        stopped = client.create_session(lora=tt.LoraConfig(rank=2, alpha=4.0, seed=0))
        stopped.stop()
        yield client, live.session_id, stopped.session_id


def _stubs(address: str):
    ch = grpc.insecure_channel(address)
    return ch, session_pb2_grpc.SessionServiceStub(ch), generator_pb2_grpc.GeneratorServiceStub(ch), \
        resource_pb2_grpc.ResourceServiceStub(ch)


def _h(sid: str) -> session_pb2.OperationHeader:
    return session_pb2.OperationHeader(session_id=sid, seq_id=0, idempotency_key=f"order-{time.monotonic_ns()}")


# (name, call(stubs, sid, metadata)): every payload is bad, so a payload-first check answers INVALID_ARGUMENT.
GRPC_CALLS = {
    "Forward": lambda s, sid, md: s[1].Forward(session_pb2.ForwardRequest(header=_h(sid), loss_fn="cross_entropy"),
                                               metadata=md),
    "ForwardBackward": lambda s, sid, md: s[1].ForwardBackward(
        session_pb2.ForwardRequest(header=_h(sid), loss_fn="no-such-loss"), metadata=md),
    "CustomForwardBackward": lambda s, sid, md: s[1].CustomForwardBackward(
        session_pb2.CustomForwardBackwardRequest(header=_h(sid)), metadata=md),
    "OptimStep": lambda s, sid, md: s[1].OptimStep(
        session_pb2.OptimStepRequest(header=_h(sid), adam_params=common_pb2.AdamParams(learning_rate=-1.0)),
        metadata=md),
    "WeightsSync": lambda s, sid, md: s[1].WeightsSync(session_pb2.WeightsSyncRequest(header=_h(sid), mode=99),
                                                       metadata=md),
    "SaveState": lambda s, sid, md: s[1].SaveState(session_pb2.SaveStateRequest(header=_h(sid), name="../x"),
                                                   metadata=md),
    "SaveWeights": lambda s, sid, md: s[1].SaveWeights(session_pb2.SaveWeightsRequest(header=_h(sid), name="../x"),
                                                       metadata=md),
    "LoadState": lambda s, sid, md: s[1].LoadState(session_pb2.LoadStateRequest(header=_h(sid), uri="not a uri"),
                                                   metadata=md),
    "Sample": lambda s, sid, md: s[2].Sample(generator_pb2.SampleRequest(session_id=sid), metadata=md),
    "SampleStream": lambda s, sid, md: list(s[2].SampleStream(generator_pb2.SampleRequest(session_id=sid),
                                                              metadata=md)),
    "ComputeLogprobs": lambda s, sid, md: s[2].ComputeLogprobs(
        generator_pb2.ComputeLogprobsRequest(session_id=sid, source=generator_pb2.SESSION), metadata=md),
}


def _grpc_error(call, stubs, sid, md) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(stubs, sid, md)
    return info.value


@pytest.mark.parametrize("rpc", sorted(GRPC_CALLS))
def test_grpc_checks_the_session_before_the_payload(served, rpc):
    client, _, stopped = served
    fresh = client.create_session(lora=tt.LoraConfig(rank=2, alpha=4.0, seed=0))  # its seq_id 0 is unused
    live = fresh.session_id
    ch, *stubs = _stubs(client.address)
    stubs = [ch, *stubs]
    call = GRPC_CALLS[rpc]
    a, b = [("authorization", f"Bearer {KEY_A}")], [("authorization", f"Bearer {KEY_B}")]
    try:
        err = _grpc_error(call, stubs, live, [])
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, err.code(), err.details())
        unknown = _grpc_error(call, stubs, UNKNOWN, a)
        assert unknown.code() == grpc.StatusCode.NOT_FOUND and "session" in unknown.details(), \
            (rpc, "unknown", unknown.code(), unknown.details())
        other = _grpc_error(call, stubs, live, b)  # key B names key A's session
        assert other.code() == grpc.StatusCode.NOT_FOUND, (rpc, "other key", other.code(), other.details())
        assert other.details() == unknown.details().replace(UNKNOWN, live), (rpc, other.details(), unknown.details())
        err = _grpc_error(call, stubs, stopped, a)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "stopped" in err.details(), \
            (rpc, "stopped", err.code(), err.details())
        # The caller's live session: now the payload is refused, by the RPC or as a FAILED operation.
        try:
            op = call(stubs, live, a)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, "payload", err.code(), err.details())
        else:
            assert op.status == session_pb2.FAILED and op.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], \
                (rpc, "payload", op)
    finally:
        ch.close()
        fresh.stop()


# ----- HTTP -------------------------------------------------------------------------------------------
def _post(http: httpx.Client, path: str, key: str | None, **kw) -> httpx.Response:
    headers = dict(kw.pop("headers", {}))
    if key:
        headers["X-API-Key"] = f"tml-{key}"
    return http.post(path, headers=headers, **kw)


def _future(http: httpx.Client, key: str, fut: dict) -> dict:
    for _ in range(60):
        r = _post(http, "/api/v1/retrieve_future", key, json={"request_id": fut["request_id"]})
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 408, r.text
    raise AssertionError(f"future {fut} never ended")


def _tinker_model(http: httpx.Client) -> tuple[str, str]:
    """(client session id, model id) of a new LoRA model of key A."""
    cs = _post(http, "/api/v1/create_session", KEY_A, json={}).json()["session_id"]
    fut = _post(http, "/api/v1/create_model", KEY_A, json={
        "session_id": cs, "model_seq_id": 0, "lora_config": {"rank": 2}}).json()
    return cs, _future(http, KEY_A, fut)["model_id"]


@pytest.fixture(scope="module")
def tinker_models(served):
    """(http client, live model id, finished model id, inflight sampler id of the finished one) of key A."""
    client, _, _ = served
    http = httpx.Client(base_url=client.http_url, timeout=120)
    (_, live), (cs_done, done) = _tinker_model(http), _tinker_model(http)
    fut = _post(http, "/api/v1/save_weights_for_sampler", KEY_A, json={
        "model_id": done, "seq_id": 1, "sampling_session_seq_id": 0, "kind": "inflight"}).json()
    assert "error" not in _future(http, KEY_A, fut)
    sampler = f"{cs_done}:sample:0"
    assert _post(http, f"/api/v1/sessions/{cs_done}/finish", KEY_A, json={}).status_code == 200
    yield http, live, done, sampler
    http.close()


def _fb_body(model_id: str) -> bytes:
    from together_train_server.wire.http import tinker_wire as tw

    return tw.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy").SerializeToString()


# (name, call(http, model_id, key)): every payload is bad.
TINKER_CALLS = {
    "forward_backward": lambda h, m, k: _post(h, "/api/v1/forward_backward", k, content=_fb_body(m),
                                              headers={"content-type": "application/x-protobuf"}),
    "optim_step": lambda h, m, k: _post(h, "/api/v1/optim_step", k, json={
        "model_id": m, "seq_id": 1, "adam_params": {"learning_rate": -1.0, "no_such_key": 1}}),
    "save_weights": lambda h, m, k: _post(h, "/api/v1/save_weights", k, json={
        "model_id": m, "seq_id": 1, "path": "../x"}),
    "save_weights_for_sampler": lambda h, m, k: _post(h, "/api/v1/save_weights_for_sampler", k, json={
        "model_id": m, "seq_id": 1, "kind": "no-such-kind", "sampling_session_seq_id": 5}),
    "load_weights": lambda h, m, k: _post(h, "/api/v1/load_weights", k, json={
        "model_id": m, "seq_id": 1, "path": "tinker://x/weights/y", "optimizer": "yes"}),
}


@pytest.mark.parametrize("route", sorted(TINKER_CALLS))
def test_tinker_routes_check_the_model_before_the_payload(served, tinker_models, route):
    http, live, done, _ = tinker_models
    _, fresh = _tinker_model(http)  # its seq_id 1 is unused
    call = TINKER_CALLS[route]
    r = call(http, live, None)
    assert r.status_code == 401, (route, r.status_code, r.text)
    unknown = call(http, "ts-unknown:train:0", KEY_A)
    assert unknown.status_code == 404 and unknown.json().get("key") == "model_id", (route, unknown.text)
    other = call(http, live, KEY_B)
    assert other.status_code == 404 and other.json()["detail"] == unknown.json()["detail"].replace(
        "ts-unknown:train:0", live), (route, other.text, unknown.text)
    stopped = call(http, done, KEY_A)
    assert stopped.status_code == 400 and stopped.json().get("code") == "FAILED_PRECONDITION", (route, stopped.text)
    payload = call(http, fresh, KEY_A)  # the caller's live model: now the payload is refused (or its future fails)
    if payload.status_code == 200:
        payload = _future(http, KEY_A, payload.json())
        assert "INVALID_ARGUMENT" in payload.get("error", ""), (route, payload)
    else:
        assert payload.status_code == 400 and payload.json().get("code") == "INVALID_ARGUMENT", (route, payload.text)


def test_tinker_asample_checks_the_sampler_session_before_the_payload(served, tinker_models):
    http, _, _, sampler = tinker_models
    r = _post(http, "/api/v1/asample", KEY_A, json={"sampling_session_id": sampler, "seq_id": 1,
                                                    "prompt": {"chunks": []}, "num_samples": 0,
                                                    "sampling_params": {"max_tokens": -3}})
    assert r.status_code == 400 and r.json().get("code") == "FAILED_PRECONDITION", r.text


def test_openai_checks_the_model_before_the_payload(served):
    client, live, _ = served
    with httpx.Client(base_url=client.http_url, timeout=120) as http:
        for path, bad in (("/v1/chat/completions", {"messages": "not a list", "temperature": -5}),
                          ("/v1/completions", {"prompt": 7, "temperature": -5})):
            r = http.post(path, json={"model": "no-such-model", **bad}, headers={"Authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)


def test_together_operations_check_the_session_before_the_payload(served):
    client, live, stopped = served
    with httpx.Client(base_url=client.http_url, timeout=120) as http:
        def op(sid, key):
            return http.post(f"/v1/rl/training-sessions/{sid}/operations/forward-backward",
                             json={"samples": "bad"}, headers={"Authorization": f"Bearer {key}",
                                                               "Idempotency-Key": f"k-{time.monotonic_ns()}"})

        unknown, other, done = op(UNKNOWN, KEY_A), op(live, KEY_B), op(stopped, KEY_A)
        assert unknown.status_code == 404 and other.status_code == 404, (unknown.text, other.text)
        assert done.status_code in (400, 409) and "stopped" in done.text, done.text
        assert op(live, KEY_A).status_code == 400
