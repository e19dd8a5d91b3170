"""Start a model resource on this machine for the length of a ``with`` block.

::

    import together_train as tt

    with tt.launch_local(model=None, generators=1) as client:   # embedded SmolLM2-135M
        session = client.create_session()
        ...

`launch_local` runs ``python -m together_train_server.cli serve ...`` (the
server extra must be installed in that interpreter) in its own process group,
bound to 127.0.0.1 on a free port that the server writes to ``--port-file``
once bound, waits until ``GetCapabilities`` answers, and yields a connected
`ResourceClient`. On exit (also on exceptions and Ctrl-C) it sends SIGTERM to
the whole process group (resource and generator replicas), waits, then
SIGKILLs whatever is left, so no process stays behind.

Command-line contract with the server (``together-train serve``):
``--model DIR_OR_NAME|embedded --generators N --host 127.0.0.1 --port 0
--port-file FILE [--storage DIR] [--dtype D] [--api-key-file F] --parent-pid PID [extra_args...]``;
the server writes its bound port (decimal, a newline after it is allowed) to
FILE after binding.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

from together_train.cache import default_storage_dir
from together_train.resource_client import ResourceClient
from together_train.errors import TogetherTrainError
from together_train.retry import NO_RETRY

__all__ = ["launch_local", "LocalResource", "ServerStartError"]

_LOG_TAIL_BYTES = 8000


class ServerStartError(RuntimeError):
    """The local resource exited or did not become ready in time.

    Attributes:
        log_tail: the end of the server's log.
        returncode: its exit status, or None when it was still running (timeout).
    """

    def __init__(self, message: str, log_tail: str = "", returncode: int | None = None) -> None:
        super().__init__(f"{message}\n--- server log (tail) ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail
        self.returncode = returncode


class LocalResource:
    """A resource process on 127.0.0.1: ``with launch_local(...) as client:`` (`launch_local` is this class).

    Use as a context manager (``__enter__`` returns the connected
    `ResourceClient`), or call `start` / `stop` (e.g. in a pytest fixture).

    Args:
        model: a local Hugging Face model directory, or None / ``"embedded"``
            for the embedded SmolLM2-135M-Instruct (converted once into a cache,
            which can take a minute on the first run).
        generators: generator replica processes to spawn.
        port: port to bind; None = a free one chosen by the server.
        storage_dir: where checkpoints go (``--storage``); default: the server's.
        dtype: model dtype (``--dtype``, e.g. "float32", "bfloat16"); default: the server's.
        extra_args: more ``serve`` arguments, appended as given.
        startup_timeout: seconds to wait for the resource to answer.
        log_file: append the server's stdout/stderr here (kept); default: a
            temporary file removed on exit (its tail is in startup errors).
        api_key: start the server with this key (``--api-key-file``) and send it.
        env: extra environment variables for the server.
        server_command: argv prefix instead of ``[sys.executable, "-m",
            "together_train_server.cli"]`` (e.g. another interpreter).
        shutdown_timeout: seconds between SIGTERM and SIGKILL on exit.
        client_kwargs: keyword arguments for the `ResourceClient`.
        http_port: also serve the HTTP API (Tinker-compatible, ``--http-port``)
            on this port; 0 = a free one. None (default) = off. The bound
            address is ``client.http_url`` (``http://127.0.0.1:<port>``, the
            tinker SDK's ``base_url``) and ``LocalResource.http_port``.

    Entering it starts the server and returns the connected `ResourceClient` (``client.address`` is
    ``127.0.0.1:<port>``, ``client.local_resource`` the LocalResource).

    Raises:
        ServerStartError: (on entering) the server exited during startup or
            did not answer in time; carries the tail of its log.

    Attributes:
        client: the connected `ResourceClient` (after `start`).
        address: ``127.0.0.1:<port>`` (after `start`).
        process: the `subprocess.Popen` of the resource.
        log_path: the file receiving the server's stdout and stderr.
        command: the argv started.
        http_port: the HTTP port (after `start`, with ``http_port=`` given), else None.
        http_url: ``http://127.0.0.1:<http_port>``, the tinker SDK's ``base_url`` (or None).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        generators: int = 1,
        *,
        port: int | None = None,
        storage_dir: str | os.PathLike | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        log_file: str | os.PathLike | None = None,
        api_key: str | None = None,
        env: Mapping[str, str] | None = None,
        server_command: Sequence[str] | None = None,
        shutdown_timeout: float = 30.0,
        client_kwargs: Mapping[str, Any] | None = None,
        http_port: int | None = None,
    ) -> None:
        self.http_port = None if http_port is None else int(http_port)
        self.http_url: str | None = None
        self.model = str(model) if model is not None else "embedded"
        self.generators = int(generators)
        self.port = int(port or 0)
        self.storage_dir = storage_dir
        self.dtype = dtype
        self.extra_args = [str(a) for a in extra_args]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.api_key = api_key
        self.env = dict(env or {})
        self.server_command = list(server_command) if server_command else [sys.executable, "-m", "together_train_server.cli"]
        self.client_kwargs = dict(client_kwargs or {})
        self._user_log = pathlib.Path(log_file) if log_file is not None else None
        self._tmp: pathlib.Path | None = None
        self.log_path: pathlib.Path | None = None
        self.process: subprocess.Popen | None = None
        self.client: ResourceClient | None = None
        self.address: str | None = None
        self.command: list[str] = []

    # ------------------------------------------------------------------ start
    def start(self) -> ResourceClient:
        """Start the resource and return a connected client.

        Raises:
            ServerStartError: the process exited during startup, or did not
                answer within `startup_timeout` seconds (with the log's tail).
        """
        if self.process is not None:
            raise RuntimeError("this LocalResource was started already")
        try:
            return self._start()
        except BaseException:  # incl. KeyboardInterrupt: never leave the process behind
            self.stop()
            raise

    def _start(self) -> ResourceClient:
        self._tmp = pathlib.Path(tempfile.mkdtemp(prefix="together-train-"))
        port_file = self._tmp / "port"
        self.log_path = self._user_log or (self._tmp / "server.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            *self.server_command,
            "serve",
            "--model",
            self.model,
            "--generators",
            str(self.generators),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--port-file",
            str(port_file),
        ]
        # Always explicit, so the client resolves checkpoint paths in it (the wire carries URIs only).
        cmd += ["--storage", str(self._storage())]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.api_key:
            key_file = self._tmp / "api_keys"
            key_file.write_text(self.api_key + "\n")
            key_file.chmod(0o600)
            cmd += ["--api-key-file", str(key_file)]
        # the server shuts down if this process dies without cleanup (SIGTERM, SIGKILL)
        cmd += ["--parent-pid", str(os.getpid())]
        http_port_file = self._tmp / "http_port"
        if self.http_port is not None:
            cmd += ["--http-port", str(self.http_port), "--http-port-file", str(http_port_file)]
        cmd += self.extra_args
        self.command = cmd
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: we signal the group on exit
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        port = self._wait_for_port(port_file, deadline)
        self.address = f"127.0.0.1:{port}"
        if self.http_port is not None:
            self.http_port = self._wait_for_port(http_port_file, deadline)
            self.http_url = f"http://127.0.0.1:{self.http_port}"
        client = ResourceClient(self.address, api_key=self.api_key,
                                **{"storage_dir": self._storage(), **self.client_kwargs})
        self.client = client
        self._wait_until_serving(client, deadline)
        client.local_resource = self  # type: ignore[attr-defined]
        client.http_url = self.http_url  # type: ignore[attr-defined]
        return client

    def _storage(self) -> pathlib.Path:
        """The server's storage directory: `storage_dir`, else serve's default
        (``$TOGETHER_TRAIN_CACHE/storage`` or ``~/.cache/together-train/storage``: `cache.default_storage_dir`)."""
        if self.storage_dir is not None:
            return pathlib.Path(self.storage_dir)
        return default_storage_dir()

    def _check_alive(self) -> None:
        assert self.process is not None
        rc = self.process.poll()
        if rc is not None:
            raise ServerStartError(
                f"the resource process exited with status {rc} during startup: {' '.join(self.command)}",
                self.log_tail(),
                rc,
            )

    def _timeout(self, what: str) -> ServerStartError:
        return ServerStartError(
            f"the resource did not {what} within {self.startup_timeout:.0f} s: {' '.join(self.command)}",
            self.log_tail(),
        )

    def _wait_for_port(self, port_file: pathlib.Path, deadline: float) -> int:
        delay = 0.02
        while True:
            self._check_alive()
            try:
                text = port_file.read_text().strip()
                if text:
                    port = int(text)
                    if port > 0:
                        return port
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise self._timeout("write its port file")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _wait_until_serving(self, client: ResourceClient, deadline: float) -> None:
        """Poll GetCapabilities (no grpc_health dependency in the SDK) until it answers."""
        from together_train._proto import resource_pb2

        delay = 0.05
        while True:
            self._check_alive()
            try:
                client._call(
                    client._resource.GetCapabilities,
                    resource_pb2.GetCapabilitiesRequest(),
                    what="GetCapabilities",
                    timeout=5.0,
                    retry=NO_RETRY,
                )
                return
            except TogetherTrainError as err:
                if err.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise
            if time.monotonic() > deadline:
                raise self._timeout("answer GetCapabilities")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # ------------------------------------------------------------------ stop
    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        """The last `nbytes` of the server log ('' when there is none)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            return f.read().decode("utf-8", "replace")

    def _signal_group(self, sig: int) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> int | None:
        """Close the client, SIGTERM the process group, wait up to
        `shutdown_timeout` s, then SIGKILL the group. Idempotent. Returns the
        server's exit status (None if it never started)."""
        atexit.unregister(self.stop)
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        proc = self.process
        rc = None
        if proc is not None:
            try:
                if proc.poll() is None:
                    self._signal_group(signal.SIGTERM)
                    try:
                        proc.wait(timeout=self.shutdown_timeout)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                # Whatever is left of the group (the leader if it ignored
                # SIGTERM, replicas it did not reap) is killed outright.
                self._signal_group(signal.SIGKILL)
                try:
                    rc = proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    rc = proc.poll()
        if self._tmp is not None:
            if self.log_path is not None and self.log_path.parent == self._tmp:
                self.log_path = None  # removed with the folder
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        return rc

    def __enter__(self) -> ResourceClient:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# The factory the SDK documents (``tt.launch_local(...)``): the class itself, so its arguments are written once.
launch_local = LocalResource
