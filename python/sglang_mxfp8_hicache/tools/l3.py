"""L3 storage driven the way SGLang's cache controller drives it, without its threads.

``StoragePageIO.open`` attaches a backend as ``attach_storage_backend`` does (keys
by the release's ``storage_model_name``, so the pool's format tag is in every
key); pages move through the controller's own page functions, unbound on it,
generic or zero-copy as it chooses.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sglang_mxfp8_hicache import guards, releases
from sglang_mxfp8_hicache.storage import BACKENDS

LOCAL_BACKENDS = ("file", "hf3fs", "nixl")
"""Backends that run in this process with their data in a local directory."""

FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
"""Overrides ``file_storage_path`` (0.5.21 reads only it); set to the same folder."""


@dataclass(frozen=True)
class BackendConfig:
    """A backend's extra config and the environment it reads when built."""

    extra_config: dict[str, Any]
    env: dict[str, str | None]
    """Variables to set (None: to clear) before the backend is built."""

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """``env`` in ``os.environ`` while open; what was there before after."""
        saved = {name: os.environ.get(name) for name in self.env}
        try:
            _set_environ(self.env)
            yield
        finally:
            _set_environ(saved)


def _set_environ(env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def local_backend(
    backend: str,
    root: str,
    *,
    size_bytes: float = 1 << 30,
    hf3fs: dict[str, Any] | None = None,
) -> BackendConfig:
    """How to run ``backend`` (one of ``LOCAL_BACKENDS``) with its data under
    ``root``, an existing directory: ``hf3fs`` with its mock client (a sparse file
    of ``size_bytes``; ``hf3fs``: more of its config), ``nixl`` without its cleaner."""
    if backend == "file":
        return BackendConfig({"file_storage_path": root}, {FILE_DIR_ENV: root})
    if backend == "hf3fs":
        config = os.path.join(root, "hf3fs.json")
        settings = dict(file_path_prefix=os.path.join(root, "kv"), numjobs=2)
        settings.update(file_size=max(int(size_bytes), 1 << 30), entries=8)
        with open(config, "w") as f:
            json.dump(settings | (hf3fs or {}), f)
        env = {"SGLANG_HICACHE_HF3FS_CONFIG_PATH": config}
        return BackendConfig({"use_mock_hf3fs_client": True}, env)
    if backend == "nixl":
        extra = {"l3_cleaner_enabled": False}
        return BackendConfig(extra, {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": root})
    raise ValueError(f"backend must be one of {LOCAL_BACKENDS}, got {backend!r}")


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's chained per-page keys for ``tokens`` (no namespace, no salt)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=page_size)


@dataclass
class StoragePageIO:
    backend_name: str
    storage_backend: Any
    storage_host_pool: Any
    zero_copy: bool

    @property
    def mem_pool_host(self) -> Any:
        return self.storage_host_pool

    @property
    def page_size(self) -> int:
        return self.storage_host_pool.page_size

    @classmethod
    def open(
        cls,
        backend_name: str,
        host_pool: Any,
        *,
        model_name: str = "model",
        extra_config: dict | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_lcm_size: int | None = None,
    ) -> StoragePageIO:
        """A backend for ``host_pool`` configured as the controller configures it
        (``tp_lcm_size`` above ``tp_size`` with ``page_head``: split by heads)."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        one_stage = dict(pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
        config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            **one_stage,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=host_pool.layout.startswith("page_first"),
            model_name=storage_model_name(model_name, host_pool),
            tp_lcm_size=tp_lcm_size,
            should_split_heads=host_pool.layout == "page_head"
            and (tp_lcm_size or tp_size) > tp_size,
            extra_config=dict(extra_config or {}),
        )
        backend = StorageBackendFactory.create_backend(backend_name, config, host_pool)
        backend.register_mem_pool_host(host_pool)
        zero_copy = BACKENDS[backend_name].zero_copy or (
            backend_name == "dynamic" and bool(config.extra_config.get("interface_v1"))
        )
        return cls(backend_name, backend, host_pool, zero_copy)

    def _batches(self, hashes: list[str], host_indices: torch.Tensor):
        """(keys, host indices) of at most STORAGE_BATCH_SIZE pages, as the
        controller's ``_page_backup`` and ``_page_transfer`` cut them."""
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
            keys = hashes[start : start + STORAGE_BATCH_SIZE]
            tokens = slice(start * self.page_size, (start + len(keys)) * self.page_size)
            yield keys, host_indices[tokens]

    def backup(self, hashes: list[str], host_indices: torch.Tensor) -> bool:
        """Host pages to L3; stops at the first batch that fails, as the controller does."""
        from sglang.srt.managers.cache_controller import HiCacheController as C

        page_set = C._page_set_zero_copy if self.zero_copy else C._generic_page_set
        return all(page_set(self, k, i) for k, i in self._batches(hashes, host_indices))

    def fetch(self, hashes: list[str], host_indices: torch.Tensor) -> int:
        """L3 pages into host pages; the number of leading pages that arrived."""
        from sglang.srt.managers.cache_controller import HiCacheController as C
        from sglang.srt.managers.cache_controller import PrefetchOperation

        operation = PrefetchOperation("fetch", [])
        page_get = C._page_get_zero_copy if self.zero_copy else C._generic_page_get
        arrived = 0
        for keys, indices in self._batches(hashes, host_indices):
            hits = page_get(self, operation, keys, indices)
            arrived += hits
            if hits < len(keys):
                break
        return arrived

    def close(self) -> None:
        if (close := getattr(self.storage_backend, "close", None)) is not None:
            close()


def storage_model_name(model_name: str, host_pool: Any) -> str:
    """The model name the release's controller gives L3 backends for ``host_pool``
    (0.5.21 has no ``storage_model_name``: the storage guard adds the tag)."""
    if releases.device_pool_base():
        return model_name
    from sglang.srt.managers.cache_controller import storage_model_name as named

    return named(model_name, host_pool)


def sglang_backend(storage_backend: Any) -> Any:
    """The backend SGLang built, under our guard and SGLang's test injector."""
    wrappers = (guards.Guard, releases.failure_injector_type() or guards.Guard)
    while isinstance(storage_backend, wrappers):
        storage_backend = storage_backend._backend
    return storage_backend
