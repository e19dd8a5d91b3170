"""Huge requests are refused without ballooning the server's memory.

A 210 MB ForwardBackward holding 69,905,066 token ids, and a Sample with the
same ids as its prompt, used to raise the resource's RSS from 767 MB to 2.8 GB
(and 7.5 GB) before their refusal. Now gRPC's receive limit is sized from the
resource's limits (``Resource.max_request_bytes``), so such a message is
refused (RESOURCE_EXHAUSTED) before it is parsed; requests under that size but
over a count limit are refused from the message's counts, before any numpy
array is built. The server here runs with ``--max-tokens-per-batch 131072``
(twice the default), which raises both the token limit and the receive limit.

The wire bytes are built directly (packed varints repeated), not through
protobuf objects, so the test process itself stays small.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import together_train as tt
from together_train import errors
from together_train._proto import generator_pb2, session_pb2
from together_train.errors import from_rpc_error
from together_train.tensors import to_tensor

VOCAB = 49152
MAX_TOKENS = 131_072  # --max-tokens-per-batch of the server below
HUGE_IDS = 69_905_066  # as in the issue: 3-byte varints, 210 MB


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): tag, length, payload."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def packed_ids(count: int, token: int = VOCAB - 1) -> bytes:
    """``count`` copies of one token id as packed varints (49151 takes 3 bytes)."""
    return _varint(token) * count


def forward_backward_bytes(session_id: str, seq_id: int, ids: bytes) -> bytes:
    """A ForwardBackward request with one sample whose model_input is the packed ``ids``."""
    head = session_pb2.ForwardRequest(loss_fn="cross_entropy")
    head.header.session_id, head.header.seq_id = session_id, seq_id
    sample = _field(1, ids)  # Sample.model_input = 1
    return head.SerializeToString() + _field(2, sample)  # ForwardRequest.samples = 2


def sample_bytes(session_id: str, ids: bytes) -> bytes:
    head = generator_pb2.SampleRequest(session_id=session_id, num_samples=1)
    head.params.max_tokens = 4
    return head.SerializeToString() + _field(2, ids)  # SampleRequest.prompt = 2


def good_batch() -> list[tt.Sample]:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, size=(2, 11))
    return [
        tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(10, np.float32)})
        for t in toks
    ]


@pytest.fixture(scope="module")
def big_limits_resource(tiny_model_dir, tmp_path_factory):
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=tmp_path_factory.mktemp("storage"),
        extra_args=["--trainer-threads", "1", "--generator-threads", "1", "--max-tokens-per-batch", str(MAX_TOKENS)],
    ) as client:
        yield client


@pytest.fixture()
def raw_channel(big_limits_resource):
    with grpc.insecure_channel(
        big_limits_resource.address,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    ) as channel:
        yield channel


def call_raw(channel, method: str, body: bytes, response_type) -> grpc.RpcError:
    """Send pre-encoded request bytes; return the RpcError it must end with."""
    stub = channel.unary_unary(method, request_serializer=None, response_deserializer=response_type.FromString)
    with pytest.raises(grpc.RpcError) as info:
        stub(body, timeout=120)
    return info.value


def baseline_grad_norm(client) -> float:
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
        return s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120).grad_norm
    finally:
        s.stop()


def test_flag_raises_the_token_limit_and_the_receive_limit(big_limits_resource, raw_channel):
    assert big_limits_resource.get_capabilities().max_tokens_per_batch == MAX_TOKENS
    s = big_limits_resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        # 3,000,000 ids = 9 MB: over the default receive limit (~5.9 MB), under the raised one
        # (~11.8 MB), so it reaches the servicer, which refuses it from the message's counts.
        err = from_rpc_error(call_raw(raw_channel, "/together_train.v1.SessionService/ForwardBackward",
                                      forward_backward_bytes(s.session_id, 0, packed_ids(3_000_000)),
                                      session_pb2.Operation))
        assert isinstance(err, errors.InvalidArgumentError)
        assert "3000000 tokens" in str(err) and f"limit of {MAX_TOKENS}" in str(err)
        # just over the token limit in samples the context length allows: refused naming the limit
        n = 256
        samples = [tt.Sample(model_input=np.ones(n, np.int64), loss_fn_inputs={
            "target_tokens": np.ones(n, np.int64), "weights": np.ones(n, np.float32)})
            for _ in range(MAX_TOKENS // n + 1)]
        with pytest.raises(errors.InvalidArgumentError) as info:
            s.forward_backward(samples, "cross_entropy", validate=False).result(timeout=120)
        assert f"{(MAX_TOKENS // n + 1) * n} tokens" in str(info.value) and f"limit of {MAX_TOKENS}" in str(info.value)
        assert info.value.key == "samples"
    finally:
        s.stop()


def test_huge_forward_backward_is_refused_without_growing_memory(big_limits_resource, raw_channel):
    base = baseline_grad_norm(big_limits_resource)
    s = big_limits_resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
        before_info = s.info()
        pid = big_limits_resource.local_resource.process.pid
        body = forward_backward_bytes(s.session_id, before_info.next_seq_id, packed_ids(HUGE_IDS))
        assert len(body) > 200 << 20
        rss0 = rss_bytes(pid)
        t0 = time.monotonic()
        rpc_err = call_raw(raw_channel, "/together_train.v1.SessionService/ForwardBackward", body,
                           session_pb2.Operation)
        elapsed = time.monotonic() - t0
        del body
        rss1 = rss_bytes(pid)
        assert rpc_err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        # gRPC names the limit in bytes: the message size against the configured maximum
        assert "larger than max" in (rpc_err.details() or ""), rpc_err.details()
        print(f"forward_backward refused in {elapsed:.2f} s; server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
        assert rss1 <= rss0 * 1.10, (rss0, rss1)
        # the session is as it was: same next seq id, step, and accumulated gradient
        after = s.info()
        assert (after.next_seq_id, after.step) == (before_info.next_seq_id, before_info.step)
        out = s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120)
        assert out.step == 1 and out.grad_norm == pytest.approx(base, rel=1e-6)
    finally:
        s.stop()


def test_huge_sample_prompt_is_refused_without_growing_memory(big_limits_resource, raw_channel):
    s = big_limits_resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        pid = big_limits_resource.local_resource.process.pid
        body = sample_bytes(s.session_id, packed_ids(HUGE_IDS))
        rss0 = rss_bytes(pid)
        rpc_err = call_raw(raw_channel, "/together_train.v1.GeneratorService/Sample", body,
                           generator_pb2.SampleResponse)
        del body
        rss1 = rss_bytes(pid)
        assert rpc_err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        assert "larger than max" in (rpc_err.details() or ""), rpc_err.details()
        print(f"sample refused; server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
        assert rss1 <= rss0 * 1.10, (rss0, rss1)
        # A prompt small enough to pass gRPC but over the context length is refused from its
        # length, before any list or array is built.
        err = from_rpc_error(call_raw(raw_channel, "/together_train.v1.GeneratorService/Sample",
                                      sample_bytes(s.session_id, packed_ids(1_000_000)), generator_pb2.SampleResponse))
        assert isinstance(err, errors.InvalidArgumentError) and err.key == "prompt"
        assert "1000000 tokens" in str(err) and "context length 256" in str(err)
        # the session still samples
        res = s.sample([1, 2, 3], tt.SamplingParams(max_tokens=2, seed=0)).result(timeout=120)
        assert len(res.sequences[0].tokens) == 2
    finally:
        s.stop()


def test_oversized_tensor_is_refused_from_its_byte_count(big_limits_resource, raw_channel):
    """A loss_fn_inputs tensor far larger than its sample (1 MiB for 10 tokens) is refused before decoding."""
    from together_train._proto import common_pb2

    s = big_limits_resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        req = session_pb2.ForwardRequest(loss_fn="cross_entropy")
        req.header.session_id, req.header.seq_id = s.session_id, 0
        good = req.samples.add(model_input=list(range(1, 11)))
        good.loss_fn_inputs["target_tokens"].CopyFrom(to_tensor(np.arange(2, 12, dtype=np.int64)))
        bad = req.samples.add(model_input=list(range(1, 11)))
        bad.loss_fn_inputs["target_tokens"].CopyFrom(to_tensor(np.arange(2, 12, dtype=np.int64)))
        bad.loss_fn_inputs["weights"].CopyFrom(common_pb2.Tensor(dtype=common_pb2.FLOAT32, shape=[1 << 18],
                                                                  data=bytes(1 << 20)))
        err = from_rpc_error(call_raw(raw_channel, "/together_train.v1.SessionService/ForwardBackward",
                                      req.SerializeToString(), session_pb2.Operation))
        assert isinstance(err, errors.InvalidArgumentError)
        assert (err.sample_index, err.key) == (1, "weights") and f"{1 << 20} bytes" in str(err)
        assert s.info().next_seq_id == 0
    finally:
        s.stop()
