"""Who may read which usage: an admin key every key's and session's, any other key only its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from together_train_server.service.checkpoints.store import owner_tag
from together_train_server.service.errors import ServiceError
from together_train_server.service.usage.meter import UsageMeter, UsageTotals

if TYPE_CHECKING:
    from together_train_server.service.checkpoints.registry import Registry


def read_usage(meter: UsageMeter, registry: Registry, owner: str, *, admin: bool,
               session_id: str = "") -> tuple[list[UsageTotals], list[UsageTotals]]:
    """(per-key sums, per-session sums) that `owner` may see, keys and sessions sorted by tag and id.

    Args:
        meter: the resource's meter.
        registry: the model registry (``session(id)`` -> a row with ``owner``, or None).
        owner: the caller's API key ("" without keys: the one key "").
        admin: the caller is an admin key (``--admin-key-file``): every key and session.
        session_id: only this session ("" = every visible one); its key's sums are still returned.

    Raises:
        ServiceError: NOT_FOUND for an unknown session or, for a non-admin, another key's.
    """
    tag = owner_tag(owner)
    sessions = meter.sessions()
    if session_id:
        row = registry.session(session_id)
        if row is None or (not admin and row.owner != tag):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        one = sessions.get(session_id) or UsageTotals(key=row.owner, session_id=session_id)
        keys = meter.keys(sessions)
        return [keys.get(row.owner) or UsageTotals(key=row.owner)], [one]
    keys = meter.keys(sessions)
    if not admin:
        keys = {tag: keys.get(tag) or UsageTotals(key=tag)}
        sessions = {sid: s for sid, s in sessions.items() if s.key == tag}
    return ([keys[k] for k in sorted(keys)], [sessions[s] for s in sorted(sessions)])
