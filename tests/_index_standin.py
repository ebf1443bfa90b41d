"""A pure-Python stand-in for ``kvbridge.Index`` (same interface, plain dicts), used by the
routing/service tests only until the native index lands on main. Not shipped in the package.

``key="tokens"``: a block's key is Python's hash of (parent key, its tokens, lora_name, its extra
keys without the LoRA name vLLM repeats in them); ``key="engine"``: the engine's own hash.
"""

from __future__ import annotations

from typing import Any

from kvbridge.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch


def _extra(keys: Any, lora_name: str | None) -> tuple | None:
    if keys is None:
        return None
    kept = tuple(k for k in keys if k != lora_name)
    return kept or None


class StandInIndex:
    def __init__(self, block_size: int = 16, key: str = "tokens") -> None:
        if key not in ("tokens", "engine"):
            raise ValueError(f"key must be 'tokens' or 'engine', got {key!r}")
        self.block_size = block_size
        self.key = key
        self._held: dict[str, dict[Any, set]] = {}  # worker -> key -> media
        self._keys: dict[str, dict[Any, Any]] = {}  # worker -> engine hash -> key
        self._stats = dict.fromkeys(("events", "blocks", "unknown_parents", "malformed"), 0)

    def _chain(self, parent: Any, tokens: list[int], lora_name: str | None, extra_keys: Any) -> list[Any]:
        bs = self.block_size
        out = []
        for i in range(len(tokens) // bs):
            extra = _extra(extra_keys[i], lora_name) if extra_keys else None
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs]), lora_name, extra))
            out.append(parent)
        return out

    def apply(self, worker: str, data: bytes | KVEventBatch, format: str | None = None) -> int:
        if isinstance(data, (bytes, bytearray, memoryview)):
            fmt = format or ("json" if bytes(data[:1]) in (b"[", b"{") else "msgpack")
            try:
                data = decode_batch(bytes(data), fmt)
            except ValueError:
                self._stats["malformed"] += 1
                return 0
        elif not isinstance(data, KVEventBatch):
            raise TypeError(f"data must be bytes or a KVEventBatch, got {type(data).__name__}")
        held = self._held.setdefault(worker, {})
        keys = self._keys.setdefault(worker, {})
        n = 0
        for ev in data.events:
            self._stats["events"] += 1
            if isinstance(ev, BlockStored):
                if self.key == "engine":
                    new = list(ev.block_hashes)
                else:
                    parent = None
                    if ev.parent_block_hash is not None:
                        parent = keys.get(ev.parent_block_hash)
                        if parent is None:
                            self._stats["unknown_parents"] += 1
                            continue
                    new = self._chain(parent, ev.token_ids, ev.lora_name, ev.extra_keys)
                for h, k in zip(ev.block_hashes, new):
                    keys[h] = k
                    held.setdefault(k, set()).add(ev.medium)
                    n += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    k = keys.pop(h, None)
                    if k is not None:
                        media = held.get(k)
                        if media is not None:
                            media.discard(ev.medium)
                            if not media:
                                del held[k]
                    n += 1
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
                keys.clear()
        self._stats["blocks"] += n
        return n

    def find_matches(self, tokens=None, *, block_hashes=None, lora_name=None, extra_keys=None, medium=None):
        if (tokens is None) == (block_hashes is None):
            raise ValueError("give exactly one of tokens and block_hashes")
        if tokens is not None:
            for i, t in enumerate(tokens):
                if not 0 <= t < 2**32:
                    raise ValueError(f"token id at position {i} is out of range 0..2**32-1: {t}")
            wanted = list(tokens) if self.key == "tokens" else None
            if wanted is None:
                raise ValueError("key='engine' indexes need block_hashes")
            block_hashes = self._chain(None, wanted, lora_name, extra_keys)
        out = {}
        for worker, held in self._held.items():
            n = 0
            for k in block_hashes:
                media = held.get(k)
                if not media or (medium is not None and medium not in media):
                    break
                n += 1
            if n:
                out[worker] = n
        return out

    def remove_worker(self, worker: str) -> None:
        self._held.pop(worker, None)
        self._keys.pop(worker, None)

    def clear(self) -> None:
        self._held.clear()
        self._keys.clear()

    @property
    def workers(self) -> list[str]:
        return sorted(self._held)

    def __len__(self) -> int:
        return len({k for held in self._held.values() for k in held})

    @property
    def memory_bytes(self) -> int:
        return 64 * sum(len(h) for h in self._held.values())

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._stats)
