"""In-test L3 backends that SGLang loads with ``--hicache-storage-backend dynamic``.

Each keeps pages in the module's ``STORE`` under the controller's key and the
storage config's model and rank, as a third-party backend would; none checks
sizes itself, so what reaches the host pool is what the plugin's guard lets
through. ``DictStore`` serves SGLang's generic interface (flat page tensors),
``DictStoreV1`` its zero-copy one (``interface_v1``: pointers from the pool's
``get_page_buffer_meta``). Set ``FAULTS`` to make the classes misbehave.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

STORE: dict[str, bytes] = {}
FAULTS: set[str] = set()
"""``raise``: every read raises; ``fill``: a generic read copies what is stored
into the target as far as it fits and returns the target, whatever its size."""
_LOCK = threading.Lock()


def extra_config(v1: bool) -> dict:
    """The extra config that makes SGLang load ``DictStoreV1`` (``v1``) or
    ``DictStore`` from this module."""
    return {
        "backend_name": "dict",
        "module_path": __name__,
        "class_name": "DictStoreV1" if v1 else "DictStore",
        **({"interface_v1": 1} if v1 else {}),
    }


class DictStore(HiCacheStorage):
    """Generic interface. A read returns the target filled with the stored
    bytes when they fit it exactly, else a tensor of the stored bytes."""

    def __init__(self, storage_config, kwargs):
        config = storage_config
        self.suffix = f"_{config.model_name}_{config.tp_rank}_{config.tp_size}"

    def store_key(self, key: str) -> str:
        return key + self.suffix

    def _stored(self, key: str) -> bytes | None:
        if "raise" in FAULTS:
            raise ConnectionError("dict store unreachable")
        with _LOCK:
            return STORE.get(self.store_key(key))

    def get(self, key, target_location=None, target_sizes=None):
        data = self._stored(key)
        if data is None:
            return None
        # Copied straight from the stored bytes: a page's worth allocated per
        # read would time this process's allocator, not the pools.
        stored = np.frombuffer(data, dtype=np.uint8)
        target = target_location.view(torch.uint8).numpy()
        if "fill" in FAULTS:
            n = min(len(data), len(target))
            target[:n] = stored[:n]
            return target_location
        if len(data) != len(target):
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        target[:] = stored
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        data = value.contiguous().view(torch.uint8).numpy().tobytes()
        with _LOCK:
            STORE[self.store_key(key)] = data
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key):
        with _LOCK:
            return self.store_key(key) in STORE

    def batch_exists(self, keys, extra_info=None):
        found = 0
        while found < len(keys) and self.exists(keys[found]):
            found += 1
        return found


class DictStoreV1(DictStore):
    """Zero-copy interface: a page is its ``get_page_buffer_meta`` parts back
    to back; a read copies the stored bytes into them in order, as far as
    they go, and reports a hit for every key it holds."""

    def _parts(self, host_indices) -> list[list[tuple[int, int]]]:
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        pages = len(host_indices) // self.mem_pool_host.page_size
        per = len(pointers) // pages
        parts = list(zip(pointers, sizes, strict=True))
        return [parts[i : i + per] for i in range(0, len(parts), per)]

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        for key, parts in zip(keys, self._parts(host_indices), strict=True):
            data = b"".join(ctypes.string_at(p, n) for p, n in parts)
            with _LOCK:
                STORE[self.store_key(key)] = data
        return [True] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        hits = []
        for key, parts in zip(keys, self._parts(host_indices), strict=True):
            data = self._stored(key)
            hits.append(data is not None)
            address = np.frombuffer(data, np.uint8).ctypes.data if data else 0
            offset = 0
            for pointer, size in parts if data is not None else ():
                n = max(0, min(size, len(data) - offset))
                ctypes.memmove(pointer, address + offset, n)
                offset += n
        return hits
