"""Real processes for tests: `kestrel serve` workers and SGLang's router on loopback, started until healthy and
stopped with one signal (whose exit code the caller checks)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Run `cmd` with its output in `log_path` (a file: a full pipe would block it), one intra-op thread."""
    with open(log_path, "w") as log_file:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.Popen(cmd, stderr=log_file, stdout=log_file, env=env)


def start(cmd: list[str], log_path: Path, health_url: str, timeout: float = 90, env: dict | None = None):
    """`spawn`, then return once `health_url` is 200."""
    proc = spawn(cmd, log_path, env)
    wait_healthy(proc, log_path, health_url, timeout)
    return proc


def wait_healthy(proc: subprocess.Popen, log_path: Path, health_url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(health_url, timeout=5).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args[:4]} did not come up:\n" + log_path.read_text()[-4000:])
        time.sleep(0.1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int | None:
    """Signal once (a second SIGINT means "force quit" to uvicorn); kill if it outlives 30 s; the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def kestrel_serve(port: int, *flags: str, launcher: str | None = None) -> list[str]:
    """The command line of `kestrel serve` (or of `launcher`, a `python -c` program that ends in the CLI)."""
    head = [sys.executable, "-c", launcher] if launcher else [sys.executable, "-m", "kestrel.cli"]
    return [*head, "serve", "--port", str(port), *flags]


def router_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), *args]
