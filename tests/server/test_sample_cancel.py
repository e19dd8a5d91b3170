"""A sample whose caller goes away leaves the replica's batch (issue 23, "Shutdown and cancellation").

A real resource (``launch_local``, one spawned replica, API key, HTTP port) on a tiny random Llama
with a 4,096-token context, so one request can decode for thousands of steps. What the replica did
is read from outside, from the replica's own Health (``sampled_tokens``: every token its engine
sampled, cancelled requests' too), with the resource's replica secret read from the replica's
command line as in test_security_replicas.py:

- the counter itself: a finished request of N tokens (``ignore_eos``) adds exactly N;
- an OpenAI client (the ``openai`` package) that opens a ``stream=true`` chat completion with
  max_tokens 4,000, reads 2 chunks and closes the response: the replica stops adding tokens
  (the counter holds still, its outstanding requests reach 0) well before 4,000;
- the SDK's ``sample(...).cancel()`` while the replica decodes: True, the future is cancelled
  (OperationCancelledError), and the replica stops the same way.

On the code before this change both kept the replica decoding to max_tokens (4,000 tokens added).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest

import together_train as tt
from _served import launch_with_http
from together_train._proto import generator_pb2, generator_pb2_grpc

openai = pytest.importorskip("openai")

KEY = "sk-cancel-test"
SECRET_KEY = "together-train-replica-secret"
CONTEXT = 4096
MAX_TOKENS = 4000
# The replica must stop within a few decode steps of the cancel; a quarter of max_tokens leaves
# room for a slow, loaded machine (the cancel travels client -> resource -> replica) and still
# fails by 3,000 tokens when nothing is cancelled.
STOPPED_BELOW = MAX_TOKENS // 4


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from _models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), arch="llama", seed=0, max_positions=CONTEXT)


@pytest.fixture(scope="module")
def served(long_model_dir, tmp_path_factory):
    with launch_with_http(long_model_dir, tmp_path_factory.mktemp("cancel"), KEY) as client:
        yield client


@pytest.fixture(scope="module")
def replica(served):
    """The spawned replica's Health, called with the resource's secret: () -> HealthResponse."""
    out = subprocess.run(["pgrep", "-P", str(served.local_resource.process.pid)], capture_output=True, text=True)
    (pid,) = [int(x) for x in out.stdout.split()]
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    port = int(Path(argv[argv.index("--port-file") + 1]).read_text())
    secret = Path(argv[argv.index("--replica-secret-file") + 1]).read_text().strip()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = generator_pb2_grpc.GeneratorServiceStub(channel)
    yield lambda: stub.Health(generator_pb2.HealthRequest(), timeout=30, metadata=((SECRET_KEY, secret),))
    channel.close()


def _settled(replica, timeout: float = 60.0) -> tuple[int, float]:
    """(sampled_tokens, seconds waited) once the replica has no request and its counter held still for 1 s."""
    t0 = time.monotonic()
    last = replica()
    while time.monotonic() - t0 < timeout:
        time.sleep(1.0)
        now = replica()
        if now.outstanding_requests == 0 and now.sampled_tokens == last.sampled_tokens:
            return int(now.sampled_tokens), time.monotonic() - t0
        last = now
    pytest.fail(f"the replica still decodes {timeout:.0f} s later: sampled_tokens {last.sampled_tokens}, "
                f"outstanding {last.outstanding_requests}")


def _started(replica, before: int, timeout: float = 60.0) -> int:
    """Block until the replica sampled a token beyond `before`; returns the counter then."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = int(replica().sampled_tokens)
        if now > before:
            return now
        time.sleep(0.02)
    pytest.fail(f"the replica sampled nothing in {timeout:.0f} s")


def test_sampled_tokens_counts_exactly(served, replica):
    before, _ = _settled(replica)
    res = served.sample([1, 2, 3], tt.SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)).result(
        timeout=120)
    after, _ = _settled(replica)
    assert len(res.sequences[0].tokens) == 20
    assert after - before == 20, f"counter went {before} -> {after} for a 20-token request"


def test_openai_stream_closed_after_two_chunks_stops_the_replica(served, replica):
    oai = openai.OpenAI(base_url=f"{served.local_resource.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    before, _ = _settled(replica)
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story"}],
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True)
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 2:
            break
    at_close = int(replica().sampled_tokens) - before
    stream.close()
    after, waited = _settled(replica)
    used = after - before
    print(f"openai stream: {len(got)} chunks read, replica had sampled {at_close} tokens at close, "
          f"{used} in all (settled after {waited:.1f} s), max_tokens {MAX_TOKENS}")
    assert len(got) == 2
    assert used < STOPPED_BELOW, f"the replica sampled {used} tokens of a stream closed after 2 chunks"


def test_sdk_sample_cancel_stops_the_replica(served, replica):
    before, _ = _settled(replica)
    fut = served.sample([1, 2, 3, 4], tt.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                                        ignore_eos=True))
    at_cancel = _started(replica, before) - before
    assert fut.cancel() is True
    assert fut.cancelled()
    with pytest.raises(tt.OperationCancelledError):
        fut.result(timeout=30)
    after, waited = _settled(replica)
    used = after - before
    print(f"sdk cancel: replica had sampled {at_cancel} tokens at cancel, {used} in all (settled after "
          f"{waited:.1f} s), max_tokens {MAX_TOKENS}")
    assert used < STOPPED_BELOW, f"the replica sampled {used} tokens of a sample cancelled after {at_cancel}"
    # the resource and replica still serve: a new request is answered in full
    res = served.sample([1, 2, 3], tt.SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)).result(
        timeout=120)
    assert len(res.sequences[0].tokens) == 8
