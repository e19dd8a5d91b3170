"""`TenancyConfig`: how a resource shares its trainer among API keys.

Serve's flags for it (``--scheduler``, ``--max-sessions-per-key``, ...) are `ServeConfig` fields
(config.py, `ServeConfig.tenancy`), so a new limit is one field here, one flag field there and one
check in `quotas.Quotas`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from together_train_server.service.core.scheduler import SCHEDULERS


@dataclass(frozen=True)
class TenancyConfig:
    """Scheduler and per-key limits of a resource (0 = no limit). A key is an API key; without
    ``--api-key-file`` every caller is the one key "".

    Attributes:
        scheduler: ``fair`` (deficit round-robin across keys, then a key's sessions, charged by tokens) or
            ``fifo`` (arrival order); one of `SCHEDULERS`.
        max_sessions_per_key: active sessions one key may hold.
        max_queued_per_key: trainer operations one key may have queued or running at once.
        max_tokens_per_key: model_input tokens one key may train on and score in the resource's lifetime.

    Raises:
        ValueError: an unknown scheduler or a negative limit (naming the field).
    """

    scheduler: str = "fair"
    max_sessions_per_key: int = 0
    max_queued_per_key: int = 0
    max_tokens_per_key: int = 0

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler {self.scheduler!r}: one of {list(SCHEDULERS)}")
        for f in dataclasses.fields(self):
            if f.type == "int" and getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
