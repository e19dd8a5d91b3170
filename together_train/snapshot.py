"""`Snapshot`: a session's weights fixed at one point of its operation order, sampled while it trains on."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from together_train._async import returns_future, with_async_twins
from together_train._proto import session_pb2
from together_train.errors import FailedPreconditionError, TogetherTrainError

if TYPE_CHECKING:
    from together_train._client_handle import ClientHandle
    from together_train.futures import OperationFuture
    from together_train.types import ComputeLogprobsResult, SampleResult, SamplingParams, TokenArray

logger = logging.getLogger(__name__)

__all__ = ["Snapshot"]


def _release_later(client: ClientHandle, snapshot_id: str) -> None:
    """Best-effort release of a snapshot whose handle was garbage-collected (never raises, never blocks)."""
    if client.closed:
        return
    try:
        client._submit_call("release_snapshot", lambda: _release(client, snapshot_id), None, None)
    except Exception as err:  # the client is closing: the resource drops it when it needs the room
        logger.debug("could not release snapshot %s: %s", snapshot_id, err)


def _release(client: ClientHandle, snapshot_id: str) -> bool:
    msg = client._call(client._sessions.ReleaseSnapshot, session_pb2.ReleaseSnapshotRequest(snapshot_id=snapshot_id),
                       what="ReleaseSnapshot")
    return bool(msg.released)


@with_async_twins
class Snapshot:
    """Fixed weights of a session (`Session.snapshot`): samples and logprobs from the adapter as it was when
    the snapshot was taken, whatever the session trains or syncs afterwards (Tinker's
    ``save_weights_and_get_sampling_client``).

    The resource keeps it on its replicas until `close` (or the context manager's exit, or, best effort, this
    handle's garbage collection) releases it; it also drops the least recently used one when it holds more
    than its limit (8 by default). A released or dropped snapshot refuses further use with
    `FailedPreconditionError` naming it.

    Attributes:
        snapshot_id: its id on the resource (``snap-<hex>``).
        session_id: the session it was taken from.
        policy_version: the session's step when it was taken (-1: the session's fresh adapter, B = 0,
            which is the base model).
    """

    def __init__(self, client: ClientHandle, snapshot_id: str, session_id: str, policy_version: int) -> None:
        self.client = client
        self.snapshot_id = snapshot_id
        self.session_id = session_id
        self.policy_version = int(policy_version)
        self._released = False
        self._finalizer = weakref.finalize(self, _release_later, client, snapshot_id)
        self._finalizer.atexit = False  # at exit the channel is going away with everything else

    def __repr__(self) -> str:
        state = " released" if self._released else ""
        return f"<Snapshot {self.snapshot_id} of {self.session_id} v{self.policy_version}{state}>"

    @property
    def released(self) -> bool:
        """Whether `close` released it (through this handle)."""
        return self._released

    def _check(self) -> None:
        if self._released:
            raise FailedPreconditionError(f"snapshot {self.snapshot_id} was released (Snapshot.close): take a new "
                                          "one with Session.snapshot()", key="snapshot_id")

    @returns_future
    def sample(self, prompt_tokens: TokenArray, sampling_params: SamplingParams, num_samples: int = 1, *,
               prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
               validate: bool = True) -> OperationFuture[SampleResult]:
        """Sample completions from the snapshot's weights; arguments as `Session.sample`.

        Returns:
            Future of `SampleResult`; its ``policy_version`` is the snapshot's.

        Raises:
            FailedPreconditionError: released (here at once, or from ``result()`` when the resource dropped it).
            NotFoundError: from ``result()``: the resource does not know it (another API key's).
        """
        self._check()
        return self.client._sample("", prompt_tokens, sampling_params, num_samples, prompt_logprobs,
                                   top_k_prompt_logprobs, None, validate, snapshot_id=self.snapshot_id)

    @returns_future
    def compute_logprobs(self, sequences: Sequence[TokenArray]) -> OperationFuture[ComputeLogprobsResult]:
        """Score token sequences with the snapshot's weights (untempered float32, len - 1 per sequence).

        Raises:
            FailedPreconditionError / NotFoundError: as `sample`.
        """
        self._check()
        return self.client._compute_logprobs("", sequences, "snapshot", None, None, snapshot_id=self.snapshot_id)

    def close(self) -> None:
        """Release the snapshot on the resource (its replicas drop the weights). Idempotent; a closed
        client only forgets it (the resource drops it when it needs the room)."""
        if self._released:
            return
        self._released = True
        self._finalizer.detach()
        if self.client.closed:
            return
        try:
            _release(self.client, self.snapshot_id)
        except TogetherTrainError as err:
            if err.code != "NOT_FOUND":
                raise

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
