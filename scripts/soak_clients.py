"""The soak's training sessions, one class per SDK (used by scripts/soak.py).

Each class opens one session (fresh, or resumed with its optimizer from a checkpoint URI
``together-train://<session>/state/<name>``), runs one training step, a weights sync (+ a sample
where the SDK's session has one), and a save_state, all through its own official client:

- `GrpcSession`: the gRPC SDK (``together_train``);
- `TinkerSession`: the tinker SDK on the HTTP port (key ``tml-soak``);
- `TogetherSession`: the together SDK's ``together.post_training`` on the HTTP port.

Every backend reports the session's step counter after an optim_step as the resource counts it
(the optim_step's own result, or ``GetSession`` where the SDK's result has no step), so a step
that ran twice shows up as a counter that skips. A save refused by the injected fault
(``TOGETHER_TRAIN_TEST_FAULTS=save_state:K``) raises `SaveRefused`; any other error propagates.
"""

from __future__ import annotations

import contextlib

import numpy as np

import together_train as tt

# Every field explicit: the three SDKs have different defaults (tinker: beta2 0.95, eps 1e-12), and the
# replay retrains every session's stretch through the gRPC SDK with these exact values.
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-4, weight_decay=0.0, grad_clip_norm=0.0)
LORA_RANK, LORA_ALPHA = 4, 8.0
OP_TIMEOUT_S = 300
INJECTED = ("InjectedFault", "injected test fault")  # how the fault hook's failure reads in each SDK's error


class SaveRefused(Exception):
    """save_state failed with the injected fault (the save must not be listed; training goes on)."""


def _refused(e: Exception) -> bool:
    return any(m in str(e) for m in INJECTED)


def grpc_samples(rows) -> list[tt.Sample]:
    """SDK samples of (input ids, target ids, weights) rows."""
    return [tt.Sample(model_input=np.asarray(i), loss_fn_inputs={"target_tokens": np.asarray(t),
                                                                 "weights": np.asarray(w, np.float32)})
            for i, t, w in rows]


class GrpcSession:
    """A session through the gRPC SDK; `client` is read on every call (the dropped-channel fault swaps it)."""

    kind = "grpc"

    def __init__(self, server, base_model: str, seed: int, resume: str | None) -> None:
        c = server.client
        if resume:
            self.session = c.create_session(checkpoint_uri=resume, with_optimizer=True)
        else:
            self.session = c.create_session(lora=tt.LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, seed=seed))
        self.session_id = self.session.session_id

    def reattach(self, client: tt.ResourceClient) -> None:
        """The same session from a new client (its next seq_id continues)."""
        self.session = client.session(self.session_id)

    def _result(self, fut):
        """`fut`'s result; when the dropped-channel fault closed the client under it, the same operation's
        result through the re-attached session (as ClientClosedError says: the operation runs on the
        server once; a resend or a resume from a checkpoint is not needed)."""
        try:
            return fut.result(timeout=OP_TIMEOUT_S)
        except tt.errors.ClientClosedError as e:
            if not e.operation_id:
                raise
            return self.session.operation(e.operation_id).result(timeout=OP_TIMEOUT_S)

    def train_step(self, rows) -> int:
        self.session.forward_backward(grpc_samples(rows), "cross_entropy")
        return int(self._result(self.session.optim_step(tt.AdamParams(**ADAM))).step)

    def sync_and_sample(self, step: int) -> None:
        self._result(self.session.weights_sync())
        params = tt.SamplingParams(max_tokens=4, temperature=0.0)
        try:
            r = self.session.sample([5, 6, 7], params).result(timeout=OP_TIMEOUT_S)
        except (tt.errors.ClientClosedError, tt.errors.OperationCancelledError):
            r = self.session.sample([5, 6, 7], params).result(timeout=OP_TIMEOUT_S)  # no side effect: again
        assert r.policy_version == step, f"sampled policy_version {r.policy_version}, session at step {step}"

    def save(self, name: str) -> tuple[int, str]:
        try:
            ck = self._result(self.session.save_state(name))
        except tt.errors.TogetherTrainError as e:
            # Only the injected fault is a failed save: e.g. a ClientClosedError from a dropped channel may
            # still land the save, so it is neither failed nor a checkpoint to resume from.
            if _refused(e):
                raise SaveRefused(str(e)) from e
            raise
        return int(ck.step), ck.uri

    def close(self) -> None:
        pass


class TinkerSession:
    """A session (a tinker training client) through the tinker SDK; its step counter read over gRPC."""

    kind = "tinker"

    def __init__(self, server, base_model: str, seed: int, resume: str | None) -> None:
        import tinker

        self.server, self.T = server, tinker.types
        self.sc = tinker.ServiceClient(base_url=server.url, api_key="tml-soak")
        if resume:
            path = "tinker://" + resume.split("://", 1)[1].replace("/state/", "/weights/", 1)
            tc = self.sc.create_training_client_from_state_with_optimizer(path)
        else:
            # train_unembed=False: the unembedding's LoRA would make each checkpoint ~50 MB on an hour's run
            tc = self.sc.create_lora_training_client(base_model=base_model, rank=LORA_RANK, seed=seed,
                                                     train_unembed=False)
        self.tc = tc.result(timeout=OP_TIMEOUT_S) if hasattr(tc, "result") else tc  # a future in newer SDKs
        # the tinker SDK names our session only as its training run (created before the RestClient:
        # the SDK deadlocks otherwise, see tests/conformance/test_tinker_contract_gaps.py)
        run = tinker.RestClient(base_url=server.url, api_key="tml-soak").get_training_run(
            self.tc.get_info().model_id)
        self.session_id = (run.result() if hasattr(run, "result") else run).training_run_id

    def train_step(self, rows) -> int:
        T = self.T
        data = [T.Datum(model_input=T.ModelInput.from_ints(list(i)), loss_fn_inputs={"target_tokens": t, "weights": w})
                for i, t, w in rows]
        self.tc.forward_backward(data, "cross_entropy").result(timeout=OP_TIMEOUT_S)
        self.tc.optim_step(T.AdamParams(**ADAM)).result(timeout=OP_TIMEOUT_S)
        return int(self.server.client.get_session(self.session_id).step)  # the SDK's result has no step

    def sync_and_sample(self, step: int) -> None:
        pass  # sampling through tinker saves sampler weights each time: left to the gRPC sessions

    def save(self, name: str) -> tuple[int, str]:
        try:
            path = self.tc.save_state(name).result(timeout=OP_TIMEOUT_S).path  # tinker://<session>/weights/<name>
        except Exception as e:
            if _refused(e):
                raise SaveRefused(str(e)) from e
            raise
        uri = "together-train://" + path[len("tinker://"):].replace("/weights/", "/state/", 1)
        step = next(c.step for c in self.server.client.list_checkpoints(session_id=self.session_id) if c.uri == uri)
        return int(step), uri

    def close(self) -> None:
        # Stops its heartbeat thread (after a restart it would log the new server's 404 every 10 s). The
        # session may be gone with a killed server: the close is not waited for and its error is dropped.
        with contextlib.suppress(Exception):
            self.sc.close("interrupted", detail="the soak re-opens this session")


class TogetherSession:
    """A session through the together SDK (``together.post_training``)."""

    kind = "together"

    def __init__(self, server, base_model: str, seed: int, resume: str | None) -> None:
        from together import post_training as pt

        self.mr = pt.ModelResourcesClient.create(api_key="soak", base_url=server.url, base_model=base_model,
                                                 interval=0.1)
        if resume:
            cid = resume.split("://", 1)[1].replace("/", ".")  # the SDK's id: <session>.<kind>.<name>
            self.sess = self.mr.create_session(resume_from_checkpoint_id=cid, load_optimizer=True, interval=0.1)
        else:
            self.sess = self.mr.create_session(lora_config={"rank": LORA_RANK, "alpha": LORA_ALPHA, "seed": seed},
                                               interval=0.1)
        self.session_id = self.sess.session_id

    def train_step(self, rows) -> int:
        samples = [{"model_input": {"chunks": [{"encoded_text": {"tokens": list(i)}}]},
                    "loss_fn_inputs": {"target_tokens": {"data": list(t), "dtype": "int64"},
                                       "weights": {"data": list(w), "dtype": "float32"}}} for i, t, w in rows]
        self.sess.trainer.forward_backward(samples=samples, loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
                                           timeout=OP_TIMEOUT_S, interval=0.05)
        return int(self.sess.trainer.optim_step(adam_params=ADAM, timeout=OP_TIMEOUT_S, interval=0.05).step)

    def sync_and_sample(self, step: int) -> None:
        self.sess.trainer.weights_sync(timeout=OP_TIMEOUT_S, interval=0.05)

    def save(self, name: str) -> tuple[int, str]:
        try:
            ck = self.sess.create_training_checkpoint(interval=0.05)  # the SDK names it
        except Exception as e:
            if _refused(e):
                raise SaveRefused(str(e)) from e
            raise
        sid, kind, cname = ck.id.split(".", 2)
        return int(ck.step), f"together-train://{sid}/{kind}/{cname}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.mr.detach()


BACKENDS = {c.kind: c for c in (GrpcSession, TinkerSession, TogetherSession)}
