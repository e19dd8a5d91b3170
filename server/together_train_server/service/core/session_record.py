"""`SessionRecord`: the service's state of one training session (adapter, optimizer step, queue, versions),
and the session states. Read by the resource's mixins (`sessions`, `training_ops`, `weights_publishing`, ...)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

from together_train_server.engines.types import LoraConfig
from together_train_server.service.core.operations import SessionQueue

ACTIVE, STOPPED, EXPIRED = "ACTIVE", "STOPPED", "EXPIRED"


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
    # Policy version the replicas serve for this session. Version 0 is the
    # freshly initialised adapter (B = 0), identical to the base model.
    synced_version: int = 0
    step: int = 0
    # The session's last weights publish (push to the replicas), run off the trainer worker;
    # the next one starts after it, so a session's pushes reach the replicas in order.
    publish_tail: concurrent.futures.Future | None = None

    @property
    def next_seq_id(self) -> int:
        """The seq_id the session's next operation must carry (its queue's counter)."""
        return self.queue.next_seq_id

    @property
    def publish_pending(self) -> bool:
        """Whether a weights publish of this session is still on its way to the replicas."""
        tail = self.publish_tail
        return tail is not None and not tail.done()
