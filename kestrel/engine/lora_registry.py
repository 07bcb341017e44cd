"""Which LoRA adapters the engine serves: under which names, at which version, in which prefix-cache namespace.

An upsert (`load(..., replace=True)`) swaps the adapter behind a name between two engine steps. Requests that
already computed tokens with the old version keep it: it stays loaded under a retired alias until the last of them
leaves, so no request mixes two versions of one adapter. Requests not started yet take the new version, and each
version gets its own cache namespace, so none of them reuses KV computed by the other version.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

from kestrel.cache.keys import IMAGE_KEY_BASE
from kestrel.engine.request import Request, RequestStatus
from kestrel.models.lora import CONFIG_FILE, LoRAManager, load_peft, validate

SHA256_PREFIX = "sha256:"


@dataclass
class AdapterVersion:
    """One loaded adapter version."""

    name: str  # the public name requests use (a retired alias keeps its public name here)
    path: str
    version: str | None
    checksum: str  # sha256 (hex) of the adapter_model.safetensors bytes loaded
    cache_key_offset: int  # its requests' prefix-cache keys are token ids shifted by this

    def describe(self) -> dict[str, str | None]:
        return {"lora_name": self.name, "lora_path": self.path, "lora_version": self.version, "checksum": self.checksum}


def started(req: Request) -> bool:
    """The request computed tokens (running, or preempted with outputs): its adapter version is fixed."""
    return req.status is RequestStatus.RUNNING or bool(req.output_ids) or req.computed_len > 0


class AdapterRegistry:
    """Adapter versions by the name the LoRAManager holds them under (a public name or a retired alias)."""

    def __init__(self, manager: LoRAManager | None, vocab_size: int, max_rank: int | None) -> None:
        self.manager = manager
        self.vocab_size, self.max_rank = vocab_size, max_rank
        self.entries: dict[str, AdapterVersion] = {}
        self.retired: set[str] = set()  # aliases of replaced versions that running requests still use
        self._keys_used: set[int] = set()  # never reused in a run: an unloaded version's pages may linger
        self._aliases = itertools.count(1)

    @property
    def public(self) -> dict[str, AdapterVersion]:
        return {name: e for name, e in self.entries.items() if name not in self.retired}

    def load(
        self,
        name: str,
        path: str,
        requests: list[Request],
        replace: bool = False,
        version: str | None = None,
        checksum: str | None = None,
    ) -> AdapterVersion:
        """Load a PEFT adapter under `name` (`replace`: swap the version loaded under it); `requests` are the
        unfinished ones naming it. ValueError naming the problem, with nothing changed."""
        if self.manager is None:
            raise ValueError("lora: LoRA serving is off (start with --enable-lora)")
        old = self.public.get(name)
        if old is not None and not replace:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded (send replace=true to swap its version)")
        adapter = load_peft(path, name)
        want = checksum.lower().removeprefix(SHA256_PREFIX) if checksum is not None else None
        if want is not None and want != adapter.checksum:
            raise ValueError(
                f"checksum: {Path(path) / 'adapter_model.safetensors'} has sha256 {adapter.checksum}, "
                f"the request expected {want}"
            )
        validate(adapter, self.manager.model, self.max_rank)  # before the old version is touched
        if old is not None:
            users = [r for r in requests if started(r)]
            if users:
                alias = f"{name}@retired-{next(self._aliases)}"
                self.manager.rename(name, alias)
                self.entries[alias] = old
                self.retired.add(alias)
                for req in users:
                    req.lora_name = alias
            else:
                self.manager.remove(name)
            del self.entries[name]
        self.manager.add(adapter, self.max_rank)
        entry = AdapterVersion(name, str(path), version, adapter.checksum, self._new_key(path, adapter.checksum))
        self.entries[name] = entry
        for req in requests:
            if req.lora_name == name:  # not started: it will run on the new version, in its cache namespace
                req.cache_key_offset = entry.cache_key_offset
        return entry

    def _new_key(self, path: str, checksum: str) -> int:
        """A cache namespace that follows the adapter's bytes, so a disk-tier hit after a restart is the same
        adapter; shifted ids stay below the image placeholder keys (4-byte page keys)."""
        digest = hashlib.sha256((Path(path) / CONFIG_FILE).read_bytes() + checksum.encode()).digest()
        spaces = IMAGE_KEY_BASE // self.vocab_size - 1
        key = int.from_bytes(digest[:8], "little") % spaces + 1
        while key in self._keys_used:
            key = key % spaces + 1
        self._keys_used.add(key)
        return key * self.vocab_size

    def unload(self, name: str, requests: list[Request]) -> None:
        """Drop an adapter that no unfinished request names (ValueError otherwise)."""
        if name not in self.public:
            raise ValueError(f"lora_name: adapter {name!r} is not loaded")
        if requests:
            raise ValueError(f"lora_name: adapter {name!r} is in use by queued or running requests")
        self.manager.remove(name)
        del self.entries[name]

    def collect(self, in_use: set[str]) -> None:
        """Unload retired versions no unfinished request uses any more."""
        for alias in [a for a in self.retired if a not in in_use]:
            self.manager.remove(alias)
            del self.entries[alias]
            self.retired.discard(alias)

    def current(self, name: str) -> AdapterVersion | None:
        """The version a request naming `name` (public or retired) runs on if it starts over now."""
        return self.public.get(self.entries[name].name) if name in self.entries else None
