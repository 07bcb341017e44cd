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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kestrel.dist.launch import free_port
from kestrel.keepalive import CLIENT_KEEPALIVE_S
from kestrel.models.lora import WEIGHTS_FILE

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise

# A request whose connection dropped before a whole answer came back is sent again on a new one: `/generate` with a
# sampling seed and an adapter upsert with a version give the same result twice. Timeouts are not retried.
RETRIES = 2


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
        limits = httpx.Limits(max_connections=256, keepalive_expiry=CLIENT_KEEPALIVE_S)
        self.http = httpx.Client(timeout=timeout, limits=limits)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kestrel-rollout")

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()

    def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                resp = self.http.post(url + path, json=body)
                break
            except httpx.TransportError as exc:
                if attempt == RETRIES or isinstance(exc, httpx.TimeoutException):
                    raise RolloutError(f"{url}{path}: no answer ({type(exc).__name__}: {exc})") from None
                log.warning("%s%s: connection dropped (%s), sending again", url, path, type(exc).__name__)
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


def check_finite(results: list[list[dict[str, Any]]]) -> None:
    """Every sampled token has a finite logprob (the engine sends NaN / inf as null): a diverged policy stops the run
    with its cause instead of training on NaN."""
    for group in results:
        for r in group:
            for i, (lp, _, _) in enumerate(r["meta_info"]["output_token_logprobs"]):
                if lp is None:
                    raise RolloutError(
                        f"rollout {r['meta_info'].get('id')}: token {i} has a non-finite logprob (the policy "
                        "diverged: lower --lr, or resume from an earlier adapter)"
                    )


class EngineProcess:
    """`kestrel serve MODEL FLAGS` on 127.0.0.1 at a free port, as a context manager: `url` once /health answers;
    on exit it is stopped with SIGINT and `returncode` says how it ended (0: a clean stop)."""

    def __init__(
        self, model: str | None, flags: Sequence[str], log_path: Path, threads: int = 1, timeout: float = 300.0
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "kestrel.cli", "serve", *([model] if model else []), "--host", "127.0.0.1"]
        self.cmd += ["--port", str(self.port), "--num-threads", str(threads), *flags]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log_path, self.timeout = log_path, timeout
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def __enter__(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as out:
            # Its own session: a terminal's Ctrl-C reaches the trainer only, which stops the engine after its step.
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.timeout
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    log.info("rollout engine at %s (log: %s)", self.url, self.log_path)
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text()[-3000:]
                raise RolloutError(f"rollout engine did not start; its log ({self.log_path}):\n{tail}")
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGINT (uvicorn's clean shutdown), a kill after 60 s; the exit code."""
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.returncode = proc.returncode
        return self.returncode

    def __exit__(self, *exc) -> None:
        if self.stop() != 0:
            log.warning("rollout engine exited with code %s (log: %s)", self.returncode, self.log_path)
