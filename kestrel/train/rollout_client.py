"""The trainer's side of the rollout engines: `/generate` over HTTP, the adapter pushed with SGLang's sync API, and
a `kestrel serve` subprocess when the recipe brings its own engine.

Rollouts go to any SGLang-compatible endpoint: one or more `kestrel serve` workers (requests spread round-robin) or
SGLang's router in front of them. Adapters go to every engine that serves rollouts (`sync_urls`: the workers, when
the rollout URL is a router), as an upsert under one name with a version tag and the sha256 of the weights file, so
each rollout's `meta_info` says which adapter version produced it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kestrel.dist.launch import free_port
from kestrel.models.lora import WEIGHTS_FILE

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise


class RolloutError(RuntimeError):
    """An engine refused or failed a request (the message carries its answer)."""


def adapter_checksum(path: str | Path) -> str:
    """sha256 (hex) of a PEFT adapter's weights file: what `/load_lora_adapter` verifies and rollouts report."""
    return hashlib.sha256((Path(path) / WEIGHTS_FILE).read_bytes()).hexdigest()


class RolloutClient:
    """Sends `/generate` requests (one per prompt, all at once) and pushes adapters."""

    def __init__(self, urls: Sequence[str], sync_urls: Sequence[str] | None = None, timeout: float = 1800.0) -> None:
        if not urls:
            raise ValueError("rollout_urls: need at least one engine or router URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.sync_urls = [u.rstrip("/") for u in (sync_urls or urls)]
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=256))
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kestrel-rollout")

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()

    def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        resp = self.http.post(url + path, json=body)
        if resp.status_code != 200:
            raise RolloutError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def generate(
        self,
        prompts: Sequence[list[int]],
        n: int,
        max_new_tokens: int,
        seeds: Sequence[int] | None = None,
        temperature: float = 1.0,
        lora: str | None = None,
        logprobs: bool = True,
        capture: Sequence[str] = (),
    ) -> list[list[dict[str, Any]]]:
        """Per prompt, its n `/generate` results (`capture`: "routed_experts", "indexer_topk")."""

        def one(i: int) -> list[dict[str, Any]]:
            sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "n": n}
            if seeds is not None:
                sampling["sampling_seed"] = seeds[i]
            body: dict[str, Any] = {"input_ids": list(prompts[i]), "sampling_params": sampling}
            body |= {"return_logprob": logprobs, "lora_path": lora} | {f"return_{c}": True for c in capture}
            out = self._post(self.urls[i % len(self.urls)], "/generate", body)
            return out if isinstance(out, list) else [out]

        return list(self.pool.map(one, range(len(prompts))))

    def push_adapter(self, name: str, path: str | Path, version: str, checksum: str) -> None:
        """Upsert the adapter at `path` under `name` on every engine (SGLang's `/load_lora_adapter` + Kestrel's
        `replace`, `lora_version`, `checksum`); raises if one refuses."""
        body = {"lora_name": name, "lora_path": str(Path(path).resolve()), "replace": True}
        body |= {"lora_version": version, "checksum": f"sha256:{checksum}"}
        for url in self.sync_urls:
            answer = self._post(url, "/load_lora_adapter", body)
            if not answer.get("success", False):
                raise RolloutError(f"{url}/load_lora_adapter: {answer}")


def check_versions(results: list[list[dict[str, Any]]], version: str, checksum: str) -> None:
    """Every rollout ran on the adapter version just pushed (its `meta_info` names the version and checksum)."""
    for group in results:
        for r in group:
            meta = r["meta_info"]
            got = (meta.get("lora_version"), meta.get("lora_checksum"))
            if got != (version, checksum):
                raise RolloutError(f"rollout {meta.get('id')} ran on adapter {got}, expected {(version, checksum)}")


@contextlib.contextmanager
def engine_process(
    model: str | None, flags: Sequence[str], log_path: Path, threads: int = 1, timeout: float = 300.0
) -> Iterator[str]:
    """`kestrel serve MODEL FLAGS` on 127.0.0.1 at a free port; yields its URL once /health answers, stops it with
    SIGINT afterwards (a clean exit is code 0)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", *([model] if model else []), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--num-threads", str(threads), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]
                raise RolloutError(f"rollout engine did not start; its log ({log_path}):\n{tail}")
            time.sleep(0.2)
        log.info("rollout engine at %s (log: %s)", url, log_path)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode not in (0, None):
            log.warning("rollout engine exited with code %s (log: %s)", proc.returncode, log_path)
