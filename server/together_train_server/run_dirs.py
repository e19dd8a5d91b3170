"""The temporary directory of a running ``serve`` / ``deploy`` (replica secret, replica port files).

`make_run_dir` creates ``<tmp>/together-train-XXXX`` (``together-deploy-XXXX`` for deploy) holding
an ``owner.pid`` file, after removing the directories of earlier processes that died without
cleaning up (a ``kill -9``: their ``owner.pid`` names a process that no longer exists);
`remove_run_dir` deletes it on a clean stop or SIGTERM. A directory without ``owner.pid``, or
whose process is alive, is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["clean_stale", "make_run_dir", "remove_run_dir"]

log = logging.getLogger("together_train_server")
PREFIXES = ("together-train-", "together-deploy-")
OWNER = "owner.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def clean_stale(root: str | Path | None = None) -> list[Path]:
    """Remove run directories under `root` (default: the system temp dir) whose owner process is gone.

    Returns:
        The directories removed.
    """
    removed = []
    for d in Path(root or tempfile.gettempdir()).iterdir():
        if not d.name.startswith(PREFIXES) or not d.is_dir():
            continue
        try:
            pid = int((d / OWNER).read_text().strip())
        except (OSError, ValueError):
            continue  # not ours, or being created
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log.info("removed %d stale run director%s: %s", len(removed), "y" if len(removed) == 1 else "ies",
                 ", ".join(map(str, removed)))
    return removed


def make_run_dir(prefix: str = "together-train-") -> Path:
    """A new run directory owned by this process (stale ones removed first, `clean_stale`)."""
    clean_stale()
    d = Path(tempfile.mkdtemp(prefix=prefix))
    (d / OWNER).write_text(str(os.getpid()))
    return d


def remove_run_dir(d: Path) -> None:
    """Delete a run directory (its replica secret and port files); a missing one is fine."""
    shutil.rmtree(d, ignore_errors=True)
