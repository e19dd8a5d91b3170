"""Baseline for weights_sync: the same bytes through a plain gRPC client stream between two processes.

    python benchmarks/raw_grpc_stream.py --bytes N [--chunk-bytes C] [--repeats R]

A child process serves one generic stream-unary method that takes raw
``bytes`` messages (no protobuf) and answers the byte count; this process
sends `N` bytes in `C`-byte messages and times each call until the answer
(median of `R`). Nothing is hashed, converted or loaded: the floor any push
over gRPC on this machine pays. Prints ``raw_stream_ms=``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/raw.Raw/Push"
OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def serve(port_file: Path) -> None:
    """Serve METHOD on a loopback port (written to `port_file`) until killed."""
    def push(request_iterator, context):
        return str(sum(len(m) for m in request_iterator)).encode()

    handler = grpc.method_handlers_generic_handler(
        "raw.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push)})  # no (de)serializers: raw bytes
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(str(port))
    server.wait_for_termination()


def measure(nbytes: int, chunk_bytes: int, repeats: int) -> dict:
    """Median ms (and MB/s) of a stream of `nbytes` in `chunk_bytes` messages to a child process."""
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "port"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], env=env)
        try:
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None:
                    raise RuntimeError(f"raw stream server exited with {proc.returncode}")
                time.sleep(0.05)
            channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}", options=OPTIONS)
            grpc.channel_ready_future(channel).result(timeout=60)
            call = channel.stream_unary(METHOD)  # no serializers: each message is the bytes given
            data = memoryview(os.urandom(nbytes))

            def messages():  # one copy per message, as a push of pre-laid-out tensors needs
                for i in range(0, nbytes, chunk_bytes):
                    yield bytes(data[i: i + chunk_bytes])

            call(messages(), timeout=600)  # warm-up (connection, flow-control windows)
            ms = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = int(call(messages(), timeout=600))
                ms.append((time.perf_counter() - t0) * 1e3)
                assert got == nbytes, (got, nbytes)
            channel.close()
        finally:
            proc.kill()
            proc.wait()
    med = statistics.median(ms)
    return {"raw_stream_ms": med, "raw_stream_MBps": nbytes / 1e6 / (med / 1e3), "raw_stream_all_ms": ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=19537920)
    ap.add_argument("--chunk-bytes", type=int, default=8 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    r = measure(args.bytes, args.chunk_bytes, args.repeats)
    print(f"raw_stream_ms={r['raw_stream_ms']:.1f} raw_stream_MBps={r['raw_stream_MBps']:.0f} "
          f"bytes={args.bytes} chunk_bytes={args.chunk_bytes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
