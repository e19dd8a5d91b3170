"""Clients that send HTTP/2 keepalive pings during a long call are not cut off (GOAWAY too_many_pings).

The SDK pings every 60 s while a call is open (a long WaitOperation or sample).
gRPC servers by default treat pings more often than every 5 minutes without
data as abuse: after two strikes they answer GOAWAY ``too_many_pings`` and the
call fails UNAVAILABLE ("Too many pings"); this cut a main-job run short.
The servers accept pings every ``MIN_CLIENT_PING_INTERVAL_MS`` (5 s); the test
pings every 10 s for 35 s on an open stream that sends no data.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from together_train._proto import resource_pb2, resource_pb2_grpc
from together_train_server.wire.server import MIN_CLIENT_PING_INTERVAL_MS


def test_pings_during_a_long_quiet_call_do_not_end_the_connection(resource):
    assert MIN_CLIENT_PING_INTERVAL_MS < 10_000
    options = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
    with grpc.insecure_channel(resource.address, options=options) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=35)
        first = next(watch)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        t0 = time.monotonic()
        try:
            next(watch)   # nothing changes: the stream stays quiet until its deadline
            raise AssertionError("the health status changed during the test")
        except grpc.RpcError as err:
            waited = time.monotonic() - t0
            # DEADLINE_EXCEEDED after ~35 s = the connection lived; UNAVAILABLE "Too many pings" = cut off.
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (err.code(), err.details(), f"{waited:.1f} s")
        assert waited > 30, waited
        caps = resource_pb2_grpc.ResourceServiceStub(channel).GetCapabilities(
            resource_pb2.GetCapabilitiesRequest(), timeout=30)   # the same connection still answers
        assert caps.model_id
