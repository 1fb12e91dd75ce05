"""What differs between the SGLang releases this package serves, in one place.

Every other module is written for 0.5.23's interface, where a host pool is
built from an ``MHABufferInfo`` (the device pool's per-layer buffers and
scales) and keyword geometry. 0.5.21 and 0.5.22 differ where a host pool meets
SGLang:

| | 0.5.21 | 0.5.22 | 0.5.23 |
|---|---|---|---|
| a host pool is built from | the device pool: ``cls(device_pool, ratio, host_size, page_size, layout, pin_memory, device, allocator_type, *, mtp_draft_device_pools, pool_label)`` | the same | ``MHABufferInfo`` and keyword geometry |
| ``get_mha_host_pool_cls`` and ``prepare_mha_write_back_staging`` take | the device pool | the device pool | ``MHABufferInfo`` |
| ``HostKVCache.__init__`` | reads a device pool (dtype, capacity, layers) | keyword geometry without ``host_token_capacity`` | keyword geometry |
| ``_mha_host_inputs`` (where native nvfp4 scales are refused) | absent | absent | present |
| ``HiCacheStorageFailureInjector`` | absent | absent | present |
| the platform says whether the JIT HiCache kernels run | no: CUDA or ROCm | yes | yes |
| PD decode host receive is on when the threshold is | > 0 | < 1 | < 1 |
| the format in L3 keys (``storage_model_name``) | absent: the model name takes the tag | present | present |

The kernels, the JIT loader, the controllers' index moves, the L2 engine's
calls into the pool, the storage factory and the server-argument hooks are
the same in all three (``docs/releases.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec

SUPPORTED_SGLANG_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")
"""The releases this package serves (``pyproject.toml`` only bounds SGLang
below, so that installing it never moves a user's SGLang)."""
NEWEST = SUPPORTED_SGLANG_VERSIONS[-1]
"""The release every other module is written for, named in user messages."""
FIRST_BUFFER_INFO_RELEASE = "0.5.23"
"""The first release whose host pools are built from ``MHABufferInfo``."""
FIRST_KEYWORD_BASE_RELEASE = "0.5.22"
"""The first release whose ``HostKVCache.__init__`` takes keyword geometry;
it also names the host receive threshold the other way round, says in its
platform whether the HiCache kernels run, and tags L3 keys with the format."""
FIRST_SGLANG_MXFP8_HOST = "0.5.21"
"""The first release with an MXFP8 HiCache host pool of its own; older ones
(0.5.16-0.5.20 have the MXFP8 device pool) restore pages with stale scales."""
FIRST_RESOLVE_ONCE = "0.5.19"
"""The first release that resolves server arguments in ``ServerArgs.resolve_once``;
older ones do it in ``ServerArgs.__post_init__``."""


def sglang_version() -> str | None:
    """The version of the sglang that imports, which need not be pip-installed."""
    try:
        from sglang.version import __version__
    except ImportError:
        return None
    return __version__


def release(version: str) -> tuple[int, ...]:
    """(0, 5, 20) from '0.5.20', '0.5.20.post1' or '0.5.20rc0'."""
    from packaging.version import Version

    return Version(version).release


def _before(version: str) -> bool:
    return release(sglang_version() or "0") < release(version)


@functools.cache
def builds_from_device_pool() -> bool:
    """Whether this SGLang builds host pools from the device pool (0.5.21, 0.5.22)."""
    return _before(FIRST_BUFFER_INFO_RELEASE)


@functools.cache
def device_pool_base() -> bool:
    """Whether this SGLang's ``HostKVCache.__init__`` reads a device pool (0.5.21)."""
    return _before(FIRST_KEYWORD_BASE_RELEASE)


def hicache_device_kernels(platform: Any) -> bool:
    """Whether SGLang's JIT HiCache kernels run on ``platform``: it says so
    from 0.5.22 on; 0.5.21's host pools use them on CUDA and ROCm."""
    capabilities = getattr(platform, "capabilities", None)
    if capabilities is not None:
        return bool(capabilities.hicache_device_kernels)
    from sglang.srt.utils import is_cuda, is_hip

    return is_cuda() or is_hip()


def decode_host_receive(threshold: float | None) -> bool:
    """Whether PD decode receives KV into the host pool at ``threshold``
    (``--disaggregation-decode-host-receive-threshold``): 0.5.21 turns it on
    above 0 (default 0), later releases below 1 (default 1)."""
    if threshold is None:
        return False
    return threshold > 0 if device_pool_base() else threshold < 1


def storage_config_with_tag(storage_config: Any, tag: str) -> Any:
    """``storage_config`` whose model name carries the pool's format ``tag``
    where SGLang puts no format in L3 keys (0.5.21), so that pages of another
    format or geometry under the same model are misses; as it is elsewhere."""
    if not device_pool_base():
        return storage_config
    import dataclasses

    name = getattr(storage_config, "model_name", None) or "model"
    return dataclasses.replace(storage_config, model_name=f"{name}-{tag}")


class PoolBuffers(msgspec.Struct, frozen=True, kw_only=True):
    """A device pool's per-layer K and V buffers (0.5.23's ``KVBuffers``)."""

    k: tuple[Any, ...]
    v: tuple[Any, ...]
    k_data_ptrs: Any = None
    v_data_ptrs: Any = None


class PoolScales(msgspec.Struct, frozen=True, kw_only=True):
    """A device pool's per-layer K and V scale buffers (0.5.23's ``KVScaleBuffers``)."""

    k: tuple[Any, ...]
    v: tuple[Any, ...]


class PoolBufferInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What this package reads of 0.5.23's ``MHABufferInfo``, made from a
    device pool of a release that has none."""

    buffers: PoolBuffers
    page_size: int
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: Any
    device: Any
    scales: PoolScales | None = None


def buffer_info(pool_or_info: Any) -> Any:
    """``pool_or_info`` as a buffer info: 0.5.23 hands one; a device pool
    (0.5.22) gives one of its buffers, scales and geometry. Its head count is
    the rows per token when K and V are as wide, as 0.5.22's host pools count
    them."""
    if hasattr(pool_or_info, "buffers"):
        return pool_or_info
    pool = pool_or_info
    head_num = pool.head_num
    if pool.head_dim == pool.v_head_dim and hasattr(pool, "row_dim"):
        head_num = pool.row_dim // pool.head_dim
    k_scales = getattr(pool, "k_scale_buffer", None)
    scales = None
    if k_scales is not None:
        scales = PoolScales(k=tuple(k_scales), v=tuple(pool.v_scale_buffer))
    return PoolBufferInfo(
        buffers=PoolBuffers(
            k=tuple(pool.k_buffer),
            v=tuple(pool.v_buffer),
            k_data_ptrs=getattr(pool, "k_data_ptrs", None),
            v_data_ptrs=getattr(pool, "v_data_ptrs", None),
        ),
        page_size=pool.page_size,
        head_num=head_num,
        head_dim=pool.head_dim,
        v_head_dim=pool.v_head_dim,
        dtype=pool.store_dtype,
        # Where the buffers are, with the device index ("cuda:0") that SGLang's
        # host pools compare against; the pool's own may be a bare "cuda".
        device=pool.k_buffer[0].device,
        scales=scales,
    )


def device_buffer_info(device_pool: Any) -> Any:
    """``device_pool``'s buffer info on any served release: SGLang's own
    ``MHABufferInfo`` (0.5.23), else one made from the pool (``buffer_info``)."""
    if builds_from_device_pool():
        return buffer_info(device_pool)
    return device_pool.get_device_pool_infos()[0].buffer_info


def host_pool_selector_input(device_pool: Any) -> Any:
    """What this release's assembler hands ``get_mha_host_pool_cls`` (and
    ``prepare_mha_write_back_staging``) for ``device_pool``: the device pool
    itself before 0.5.23, its ``MHABufferInfo`` from then on."""
    if builds_from_device_pool():
        return device_pool
    return device_buffer_info(device_pool)


def host_pool_inputs(device_pool: Any, drafts: Sequence[Any] = ()) -> dict[str, Any]:
    """The keyword arguments (buffer info, drafts', capacity, layers) 0.5.23's
    assembler gives a host pool for ``device_pool``, on any served release."""
    info = device_buffer_info(device_pool)
    draft_infos = tuple(device_buffer_info(d) for d in drafts)
    capacity = getattr(device_pool, "host_capacity_tokens", None)
    return dict(
        buffer_info=info,
        draft_buffer_infos=draft_infos,
        device_capacity_tokens=device_pool.size if capacity is None else capacity,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
    )


@functools.cache
def built_from_device_pool(cls: type) -> type:
    """``cls`` (a host pool of 0.5.23's constructor) as a release that builds
    host pools from the device pool calls it: the same class, constructed
    from the device pool and its packed drafts."""

    def __init__(
        self,
        device_pool,
        *geometry: Any,
        mtp_draft_device_pools: Sequence[Any] = (),
        **keywords: Any,
    ) -> None:
        """``geometry`` and ``keywords``: the ratio, host size, page size,
        layout, pin_memory, device, allocator type and pool label, as the
        release passes them."""
        # Read by the release's base pool (its layer ownership helpers).
        self.device_pool = device_pool
        self.mtp_draft_device_pools = tuple(mtp_draft_device_pools)
        inputs = host_pool_inputs(device_pool, mtp_draft_device_pools)
        buffer_info = inputs.pop("buffer_info")
        cls.__init__(self, buffer_info, *geometry, **keywords, **inputs)

    return type(
        cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__}
    )


def init_host_base(host: Any, payload_info: Any, **geometry: Any) -> None:
    """SGLang's MHA host pool constructor for ``host``, given the payload's
    buffer info (0.5.23's signature: ``geometry`` holds the rest). On a
    release that builds host pools from the device pool, its base constructor
    would read a device pool and make the payload's transfer views, which an
    owned page has no use for: the geometry it sets is set here, and its
    allocating base is called with this release's keywords."""
    import torch
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if not builds_from_device_pool():
        MHATokenToKVPoolHost.__init__(host, payload_info, **geometry)
        return
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    drafts = geometry.pop("draft_buffer_infos")
    geometry.pop("write_back_staging", None)
    host.head_group_num = geometry.pop("head_group_num", 1)
    if geometry.pop("host_token_capacity", None) is not None:
        raise ValueError("this SGLang sizes host pools by ratio or size only")
    infos = (payload_info, *drafts)
    host.target_layer_num = len(payload_info.buffers.k)
    host._transfer_device = torch.device(payload_info.device)
    host.dtype = payload_info.dtype
    host.head_dim = payload_info.head_dim
    host.v_head_dim = payload_info.v_head_dim
    host.head_num = payload_info.head_num
    host.layer_num = host.target_layer_num + len(drafts)
    host.page_size = geometry["page_size"]
    if device_pool_base():
        _init_device_pool_base(host, payload_info, geometry)
    else:
        HostKVCache.__init__(
            host,
            dtype=host.dtype,
            size_per_token=host.get_size_per_token(),
            **geometry,
        )
    host.device_k_buffers = tuple(b for info in infos for b in info.buffers.k)
    host.device_v_buffers = tuple(b for info in infos for b in info.buffers.v)
    host._initialize_transfer_views(payload_info, None)


def _init_device_pool_base(host: Any, payload_info: Any, geometry: dict) -> None:
    """0.5.21's ``HostKVCache.__init__``, which reads the device pool's dtype,
    capacity and layers: given those of the payload, and the device pool put
    back (its layer-ownership helpers read it)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    device_pool = getattr(host, "device_pool", None)
    payload = SimpleNamespace(
        store_dtype=payload_info.dtype,
        size=geometry["device_capacity_tokens"],
        host_capacity_tokens=None,
        start_layer=geometry["start_layer"],
        end_layer=geometry["end_layer"],
    )
    HostKVCache.__init__(
        host,
        payload,
        geometry["host_to_device_ratio"],
        geometry["host_size"],
        geometry["page_size"],
        geometry["layout"],
        geometry["pin_memory"],
        geometry["device"],
        geometry["allocator_type"],
        pool_label=geometry["pool_label"],
    )
    host.device_pool = device_pool if device_pool is not None else payload


def failure_injector_type() -> type | None:
    """SGLang's test failure injector class (0.5.23), or None where it has none."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    except ImportError:
        return None
    return HiCacheStorageFailureInjector
