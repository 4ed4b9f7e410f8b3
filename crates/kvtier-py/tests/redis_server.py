"""A throwaway redis-server for the Python suites (tests/test_redis.py and the vLLM-in-the-loop
suite): no persistence, a temporary directory, a free loopback port; ``stop()`` kills it."""

import shutil
import socket
import subprocess
import tempfile
import time

# A hang guard for the server's start, not a speed requirement.
PATIENCE_S = 60


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed():
    return shutil.which("redis-server") is not None


class RedisServer:
    """A redis-server on a free loopback port, answering PING when the constructor returns."""

    def __init__(self):
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="kvtier-redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + PATIENCE_S
        while not self._pings():
            if self.proc.poll() is not None:
                self.dir.cleanup()
                raise RuntimeError("redis-server exited at start")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} never answered")
            time.sleep(0.02)

    def _pings(self):
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.dir.cleanup()
