"""An in-process fake resource for SDK unit tests (futures, retries, ordering).

It speaks the real wire contract over real gRPC on loopback, but computes
nothing: losses are token counts, logprobs constants. It enforces what the
SDK must respect: strict seq_id order (no hold-back: an out-of-order seq_id
is refused, which catches client ordering bugs), idempotency keys, one
operation at a time in order. Knobs: `inject` errors per method, `manual`
mode (operations wait for `release()`), per-kind delays, WaitOperation
unimplemented.

Run as a script it is a fake ``together_train_server.cli`` for the launcher
tests: ``python test_sdk_fakes.py serve --port 0 --port-file F ...``.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from together_train._proto import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    resource_pb2,
    resource_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from together_train.tensors import from_tensor, to_tensor

TERMINAL = {session_pb2.SUCCEEDED, session_pb2.FAILED, session_pb2.CANCELLED}


def status_with_detail(code: grpc.StatusCode, message: str, *, retryable=False, sample_index=None, key="", with_detail=True):
    st = status_pb2.Status(code=code.value[0], message=message)
    if with_detail:
        d = common_pb2.ErrorDetail(code=code.value[0], message=message, retryable=retryable, key=key)
        if sample_index is not None:
            d.sample_index = sample_index
        a = any_pb2.Any()
        a.Pack(d)
        st.details.append(a)
    return rpc_status.to_status(st)


class FakeResource(
    resource_pb2_grpc.ResourceServiceServicer,
    session_pb2_grpc.SessionServiceServicer,
    generator_pb2_grpc.GeneratorServiceServicer,
):
    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.lock = threading.Condition()
        self.sessions: dict[str, dict] = {}
        self.ops: dict[str, session_pb2.Operation] = {}
        self.calls: list[tuple[str, object, dict]] = []
        self.injected: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.manual = False
        self._released = 0
        self.delays: dict[str, float] = {}
        self.wait_unimplemented = False
        self.wait_cap_s = 1.0
        self.waits_in_flight = 0
        self.max_waits_in_flight = 0
        self.sample_versions_seen: list[int] = []
        self.executed: list[str] = []
        self.op_requests: dict[str, object] = {}
        self.checkpoints: dict[str, common_pb2.CheckpointInfo] = {}
        self.files: dict[str, bytes] = {"adapter_config.json": b'{"r": 4}', "sub/adapter_model.safetensors": b"0123456789"}
        self.corrupt = False
        self._queue: collections.deque[str] = collections.deque()
        self._stop = False
        self._worker = threading.Thread(target=self._work, daemon=True)
        self._worker.start()
        self.server: grpc.Server | None = None
        self.port = 0

    # ------------------------------------------------------------------ harness
    def start(self, port: int = 0) -> str:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        resource_pb2_grpc.add_ResourceServiceServicer_to_server(self, self.server)
        session_pb2_grpc.add_SessionServiceServicer_to_server(self, self.server)
        generator_pb2_grpc.add_GeneratorServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self.server is not None:
            self.server.stop(grace=None)

    def inject(self, method: str, code: grpc.StatusCode, *, times: int = 1, after: bool = False, **kw) -> None:
        """Make the next `times` calls of `method` fail with `code`; with
        after=True the request is processed first and only the reply is lost."""
        for _ in range(times):
            self.injected[method].append((code, after, kw))

    def release(self, n: int = 1) -> None:
        with self.lock:
            self._released += n
            self.lock.notify_all()

    def count(self, method: str) -> int:
        return sum(1 for m, _, _ in self.calls if m == method)

    def requests(self, method: str) -> list:
        return [r for m, r, _ in self.calls if m == method]

    # ------------------------------------------------------------------ common
    def _enter(self, method: str, request, context) -> tuple | None:
        md = dict(context.invocation_metadata())
        with self.lock:
            self.calls.append((method, request, md))
            inj = self.injected[method].popleft() if self.injected[method] else None
        if self.api_key is not None and md.get("authorization") != f"Bearer {self.api_key}":
            context.abort_with_status(status_with_detail(grpc.StatusCode.UNAUTHENTICATED, "bad api key", key="authorization"))
        if inj is not None and not inj[1]:
            code, _, kw = inj
            context.abort_with_status(status_with_detail(code, f"injected {code.name}", **kw))
        return inj

    def _exit(self, inj, context) -> None:
        if inj is not None and inj[1]:
            code, _, kw = inj
            context.abort_with_status(status_with_detail(code, f"injected {code.name} after processing", **kw))

    def _session(self, session_id: str, context) -> dict:
        s = self.sessions.get(session_id)
        if s is None:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id}", key="session_id"))
        if s["state"] != resource_pb2.ACTIVE:
            context.abort_with_status(status_with_detail(grpc.StatusCode.FAILED_PRECONDITION, "session is stopped", key="session_id"))
        return s

    def _info(self, s: dict) -> resource_pb2.SessionInfo:
        return resource_pb2.SessionInfo(
            session_id=s["id"],
            name=s["name"],
            lora=s["lora"],
            state=s["state"],
            step=s["step"],
            synced_version=s["synced"],
            next_seq_id=s["next_seq"],
            num_trainable_params=1234,
            created_at=s["created"],
        )

    # ------------------------------------------------------------------ ResourceService
    def GetCapabilities(self, request, context):
        inj = self._enter("GetCapabilities", request, context)
        self._exit(inj, context)
        return resource_pb2.Capabilities(
            protocol_version="1",
            model_id="fake",
            vocab_size=100,
            max_seq_len=64,
            mode="lora",
            operations=["forward", "forward_backward", "optim_step"],
            max_lora_rank=64,
            max_sessions=4,
            losses=[
                resource_pb2.LossSpec(
                    name="cross_entropy",
                    inputs=[
                        resource_pb2.InputSpec(name="target_tokens", dtype="int64", required=True),
                        resource_pb2.InputSpec(name="weights", dtype="float32", required=True),
                    ],
                    available=True,
                )
            ],
            sampling=resource_pb2.SamplingLimits(max_tokens=32, max_num_samples=8),
            num_replicas=1,
            adam_defaults=common_pb2.AdamParams(beta1=0.9, beta2=0.999),
        )

    def CreateSession(self, request, context):
        inj = self._enter("CreateSession", request, context)
        sid = f"s-{uuid.uuid4().hex[:8]}"
        with self.lock:
            self.sessions[sid] = dict(
                id=sid, name=request.name, lora=request.lora, state=resource_pb2.ACTIVE,
                step=0, synced=-1, next_seq=0, keys={}, created=time.time(),
            )
            info = self._info(self.sessions[sid])
        self._exit(inj, context)
        return info

    def GetSession(self, request, context):
        inj = self._enter("GetSession", request, context)
        s = self.sessions.get(request.session_id)
        if s is None:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, "unknown session", key="session_id"))
        self._exit(inj, context)
        return self._info(s)

    def ListSessions(self, request, context):
        self._enter("ListSessions", request, context)
        return resource_pb2.ListSessionsResponse(sessions=[self._info(s) for s in self.sessions.values()])

    def StopSession(self, request, context):
        self._enter("StopSession", request, context)
        s = self.sessions.get(request.session_id)
        if s is None:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, "unknown session", key="session_id"))
        with self.lock:
            s["state"] = resource_pb2.STOPPED
            for op in self.ops.values():
                if op.session_id == s["id"] and op.status == session_pb2.QUEUED:
                    self._cancel_locked(op, "session stopped")
            self.lock.notify_all()
        return self._info(s)

    def KeepAlive(self, request, context):
        self._enter("KeepAlive", request, context)
        return self._info(self._session(request.session_id, context))

    def ListCheckpoints(self, request, context):
        self._enter("ListCheckpoints", request, context)
        return resource_pb2.ListCheckpointsResponse(
            checkpoints=[c for c in self.checkpoints.values() if not request.session_id or c.session_id == request.session_id]
        )

    def DeleteCheckpoint(self, request, context):
        self._enter("DeleteCheckpoint", request, context)
        if self.checkpoints.pop(request.uri, None) is None:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, f"unknown checkpoint {request.uri}", key="uri"))
        return resource_pb2.DeleteCheckpointResponse()

    def DownloadCheckpoint(self, request, context):
        """Streams `self.files` (relative path -> bytes) in 3-byte chunks; `corrupt` sends a wrong sha256."""
        import hashlib

        self._enter("DownloadCheckpoint", request, context)
        if request.uri not in self.checkpoints:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, f"unknown checkpoint {request.uri}", key="uri"))
        for rel, data in self.files.items():
            sha = hashlib.sha256(data).hexdigest() if not self.corrupt else "0" * 64
            for off in range(0, max(len(data), 1), 3):
                yield resource_pb2.CheckpointChunk(
                    relative_path=rel, offset=off, data=data[off:off + 3], file_size=len(data), sha256=sha
                )

    # ------------------------------------------------------------------ SessionService
    def _submit(self, method: str, kind: str, request, context):
        inj = self._enter(method, request, context)
        h = request.header
        with self.lock:
            s = self._session(h.session_id, context)
            if h.idempotency_key in s["keys"]:
                op = self.ops[s["keys"][h.idempotency_key]]
            else:
                if h.seq_id != s["next_seq"]:
                    context.abort_with_status(
                        status_with_detail(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"seq_id {h.seq_id} out of order, expected {s['next_seq']}",
                            key="seq_id",
                        )
                    )
                s["next_seq"] += 1
                op = session_pb2.Operation(
                    operation_id=f"op-{uuid.uuid4().hex[:10]}",
                    session_id=h.session_id,
                    seq_id=h.seq_id,
                    kind=kind,
                    status=session_pb2.QUEUED,
                    created_at=time.time(),
                )
                self.ops[op.operation_id] = op
                s["keys"][h.idempotency_key] = op.operation_id
                self.op_requests[op.operation_id] = request
                self._queue.append(op.operation_id)
                self.lock.notify_all()
            reply = session_pb2.Operation()
            reply.CopyFrom(op)
        self._exit(inj, context)
        return reply

    def Forward(self, request, context):
        return self._submit("Forward", "forward", request, context)

    def ForwardBackward(self, request, context):
        return self._submit("ForwardBackward", "forward_backward", request, context)

    def CustomForwardBackward(self, request, context):
        self._enter("CustomForwardBackward", request, context)
        context.abort_with_status(status_with_detail(grpc.StatusCode.UNIMPLEMENTED, "custom_forward_backward is not implemented"))

    def OptimStep(self, request, context):
        return self._submit("OptimStep", "optim_step", request, context)

    def WeightsSync(self, request, context):
        return self._submit("WeightsSync", "weights_sync", request, context)

    def SaveState(self, request, context):
        return self._submit("SaveState", "save_state", request, context)

    def SaveWeights(self, request, context):
        return self._submit("SaveWeights", "save_weights", request, context)

    def LoadState(self, request, context):
        return self._submit("LoadState", "load_state", request, context)

    def _op(self, operation_id, context) -> session_pb2.Operation:
        op = self.ops.get(operation_id)
        if op is None:
            context.abort_with_status(status_with_detail(grpc.StatusCode.NOT_FOUND, f"unknown operation {operation_id}",
                                                         key="operation_id"))
        return op

    def _copy(self, op) -> session_pb2.Operation:
        out = session_pb2.Operation()
        out.CopyFrom(op)
        return out

    def GetOperation(self, request, context):
        inj = self._enter("GetOperation", request, context)
        with self.lock:
            out = self._copy(self._op(request.operation_id, context))
        self._exit(inj, context)
        return out

    def WaitOperation(self, request, context):
        inj = self._enter("WaitOperation", request, context)
        if self.wait_unimplemented:
            context.abort_with_status(status_with_detail(grpc.StatusCode.UNIMPLEMENTED, "WaitOperation is not implemented"))
        timeout = min(request.timeout_seconds or self.wait_cap_s, self.wait_cap_s)
        deadline = time.monotonic() + timeout
        with self.lock:
            self.waits_in_flight += 1
            self.max_waits_in_flight = max(self.max_waits_in_flight, self.waits_in_flight)
            try:
                op = self._op(request.operation_id, context)
                while op.status not in TERMINAL and not self._stop:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.lock.wait(left)
                out = self._copy(op)
            finally:
                self.waits_in_flight -= 1
        self._exit(inj, context)
        return out

    def _cancel_locked(self, op, reason: str) -> None:
        op.status = session_pb2.CANCELLED
        op.error.CopyFrom(common_pb2.ErrorDetail(code=grpc.StatusCode.CANCELLED.value[0], message=reason))
        op.finished_at = time.time()

    def CancelOperation(self, request, context):
        self._enter("CancelOperation", request, context)
        with self.lock:
            op = self._op(request.operation_id, context)
            if op.status == session_pb2.QUEUED:
                self._cancel_locked(op, f"operation {op.operation_id} was cancelled")
                self.lock.notify_all()
            return self._copy(op)

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            with self.lock:
                while not self._queue and not self._stop:
                    self.lock.wait()
                if self._stop:
                    return
                op = self.ops[self._queue.popleft()]
                if op.status != session_pb2.QUEUED:
                    continue
                while self.manual and self._released <= 0 and not self._stop:
                    self.lock.wait(0.05)
                    if op.status != session_pb2.QUEUED:
                        break
                if op.status != session_pb2.QUEUED or self._stop:
                    continue
                if self.manual:
                    self._released -= 1
                op.status = session_pb2.RUNNING
                op.started_at = time.time()
                self.lock.notify_all()
                delay = self.delays.get(op.kind, 0.0)
            if delay:
                time.sleep(delay)
            with self.lock:
                try:
                    self._run_locked(op)
                except ValueError as exc:
                    op.status = session_pb2.FAILED
                    op.error.CopyFrom(exc.args[0])
                op.finished_at = time.time()
                self.executed.append(op.kind)
                self.lock.notify_all()

    def _run_locked(self, op) -> None:
        req = self.op_requests[op.operation_id]
        s = self.sessions[op.session_id]
        if op.kind in ("forward", "forward_backward"):
            res = op.forward
            total = 0.0
            for i, sample in enumerate(req.samples):
                w = from_tensor(sample.loss_fn_inputs["weights"]) if "weights" in sample.loss_fn_inputs else None
                if w is not None and (w == 999).any():
                    raise ValueError(
                        common_pb2.ErrorDetail(code=3, message="weight 999 is forbidden", sample_index=i, key="weights")
                    )
                n = len(sample.model_input)
                total += n
                out = res.outputs.add()
                if req.outputs.logprobs:
                    out.logprobs.CopyFrom(to_tensor([-0.5] * n))
                if req.outputs.elementwise_loss:
                    out.elementwise_loss.CopyFrom(to_tensor([1.0] * n))
            res.loss = total
            res.metrics["num_tokens:sum"] = total
        elif op.kind == "optim_step":
            s["step"] += 1
            op.optim_step.CopyFrom(
                session_pb2.OptimStepResult(step=s["step"], grad_norm=1.5, learning_rate=req.adam_params.learning_rate)
            )
        elif op.kind == "weights_sync":
            s["synced"] = s["step"]
            op.weights_sync.CopyFrom(session_pb2.WeightsSyncResult(policy_version=s["step"], num_replicas=1, num_bytes=10))
        elif op.kind in ("save_state", "save_weights"):
            kind = "state" if op.kind == "save_state" else "weights"
            op.checkpoint.CopyFrom(
                common_pb2.CheckpointInfo(
                    uri=f"together-train://{s['id']}/{kind}/{req.name}", session_id=s["id"], kind=kind, name=req.name,
                    step=s["step"], path=f"/store/{s['id']}/{kind}/{req.name}",
                )
            )
            self.checkpoints[op.checkpoint.uri] = op.checkpoint
        elif op.kind == "load_state":
            op.load_state.CopyFrom(session_pb2.LoadStateResult(step=s["step"], with_optimizer=req.with_optimizer))
        op.status = session_pb2.SUCCEEDED

    # ------------------------------------------------------------------ GeneratorService
    def Sample(self, request, context):
        inj = self._enter("Sample", request, context)
        version = self.sessions[request.session_id]["synced"] if request.session_id else -1
        with self.lock:
            self.sample_versions_seen.append(version)
        n = request.params.max_tokens
        resp = generator_pb2.SampleResponse(policy_version=version, replica_id="r0")
        for i in range(request.num_samples or 1):
            resp.sequences.add(
                tokens=[(i + j) % 50 for j in range(n)],
                logprobs=[-0.25] * n,
                stop_reason=generator_pb2.LENGTH,
                version_spans=[generator_pb2.VersionSpan(start=0, end=n, policy_version=version)],
            )
        if request.prompt_logprobs:
            resp.prompt_logprobs.extend([-1.0] * (len(request.prompt) - 1))
        self._exit(inj, context)
        return resp

    def ComputeLogprobs(self, request, context):
        self._enter("ComputeLogprobs", request, context)
        version = self.sessions[request.session_id]["synced"] if request.session_id else -1
        return generator_pb2.ComputeLogprobsResponse(
            sequences=[generator_pb2.LogprobSequence(logprobs=[-0.1] * (len(s.tokens) - 1)) for s in request.sequences],
            policy_version=version if request.source != generator_pb2.BASE else -1,
        )


def test_fake_resource_starts_and_stops():
    fake = FakeResource()
    addr = fake.start()
    try:
        ch = grpc.insecure_channel(addr)
        caps = resource_pb2_grpc.ResourceServiceStub(ch).GetCapabilities(resource_pb2.GetCapabilitiesRequest(), timeout=5)
        assert caps.model_id == "fake"
        ch.close()
    finally:
        fake.stop()


# --------------------------------------------------------------------------- fake CLI for launcher tests


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--model")
    s.add_argument("--generators", type=int, default=1)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--port-file")
    s.add_argument("--storage")
    s.add_argument("--dtype")
    s.add_argument("--api-key-file")
    s.add_argument("--parent-pid", type=int, default=0)
    s.add_argument("--crash", action="store_true", help="exit 3 during startup")
    s.add_argument("--no-port", action="store_true", help="never write the port file")
    s.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM")
    s.add_argument("--child-pid-file", help="spawn a child process and write its pid here")
    args = p.parse_args(argv)
    import signal

    print(f"fake server starting: {argv}", flush=True)
    if args.crash:
        print("fatal: model directory does not exist", flush=True)
        return 3
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    child = None
    if args.child_pid_file:
        ignore_term = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", ignore_term])
        with open(args.child_pid_file, "w") as f:
            f.write(str(child.pid))
    key = None
    if args.api_key_file:
        key = open(args.api_key_file).read().strip()
    fake = FakeResource(api_key=key)
    fake.start(args.port)
    if not args.no_port:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{fake.port}\n")
        os.replace(tmp, args.port_file)
    print(f"fake server listening on {fake.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
