"""Standard gRPC health checking and reflection answer on the resource; capabilities; unknown checkpoints."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from together_train import errors


def test_health_serving(resource):
    with grpc.insecure_channel(resource.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "together_train.v1.ResourceService", "together_train.v1.SessionService"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(resource):
    with grpc.insecure_channel(resource.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {
        "together_train.v1.ResourceService",
        "together_train.v1.SessionService",
        "together_train.v1.GeneratorService",
        "grpc.health.v1.Health",
    } <= names


def test_capabilities_describe_the_model_and_losses(resource):
    caps = resource.get_capabilities()
    assert caps.vocab_size == 49152 and caps.max_seq_len == 256
    assert caps.num_replicas == 1
    losses = caps.losses  # name -> LossSpec
    assert {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "grpo"} <= set(losses)
    assert losses["cross_entropy"].available
    assert {i.name for i in losses["cross_entropy"].inputs} == {"target_tokens", "weights"}


def test_compute_logprobs_unknown_checkpoint_is_not_found(session):
    # compute_logprobs against a saved checkpoint is served now (tests/server/test_e2e_versions.py).
    with pytest.raises(errors.NotFoundError):
        session.compute_logprobs([[1, 2, 3]], checkpoint_uri="together-train://s-x/weights/x").result(timeout=60)
