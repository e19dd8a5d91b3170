"""`SessionRecord`: the service's state of one training session (adapter, optimizer step, queue, versions),
and the session states. Read by the resource's mixins (`sessions`, `training_ops`, `weights_publishing`, ...)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from together_train_server.engines.types import LoraConfig
from together_train_server.service.core.operations import SessionQueue

ACTIVE, STOPPED, EXPIRED = "ACTIVE", "STOPPED", "EXPIRED"


class Serving(NamedTuple):
    """What the replicas serve a session's samples with.

    Attributes:
        key: the replicas' adapter key: the session id, or "" for the base model (only while the
            replicas hold nothing but the session's fresh adapter, B = 0, which equals the base).
        version: the session's synced version (its step when last published; 0 before any push,
            -1 when there is no session: the base model itself).
    """

    key: str
    version: int


@dataclass
class SessionRecord:
    """One LoRA adapter with its optimizer, step counter and operation queue."""

    session_id: str
    name: str
    lora: LoraConfig
    queue: SessionQueue
    num_trainable_params: int
    owner: str = ""
    state: str = ACTIVE
    created_at: float = field(default_factory=time.time)
    # Any call on the session, heartbeats included (KeepAlive): the idle discard (--idle-timeout) counts from it.
    last_active_at: float = field(default_factory=time.time)
    # Calls that use the session (operations, samples), not heartbeats: idle page-out (--page-out-idle) counts
    # from it, so a client that is alive but not using its session still has it paged out.
    last_op_at: float = field(default_factory=time.time)
    # Policy version (the step) the replicas serve for this session; 0 also before any push.
    synced_version: int = 0
    step: int = 0
    # The adapter holds loaded weights (a checkpoint or an imported adapter; set by a load), so even at
    # step 0 it is not the fresh adapter (B = 0) and never the base model.
    loaded: bool = False
    # The replicas serve the base model for this session: nothing but the fresh adapter (never trained,
    # never loaded: B = 0, the base's numbers) was published. Cleared by the first push of other weights.
    serves_base: bool = True
    # The session's last weights publish (push to the replicas), run off the trainer worker;
    # the next one starts after it, so a session's pushes reach the replicas in order.
    publish_tail: concurrent.futures.Future | None = None

    @property
    def next_seq_id(self) -> int:
        """The seq_id the session's next operation must carry (its queue's counter)."""
        return self.queue.next_seq_id

    def fresh_at(self, step: int) -> bool:
        """Whether the adapter at `step` is still the fresh one (B = 0): never trained, never loaded."""
        return step == 0 and not self.loaded

    def serving(self) -> Serving:
        """The replica key and version this session's samples are served with now (see `Serving`)."""
        return Serving("" if self.serves_base else self.session_id, self.synced_version)

    @property
    def publish_pending(self) -> bool:
        """Whether a weights publish of this session is still on its way to the replicas."""
        tail = self.publish_tail
        return tail is not None and not tail.done()
