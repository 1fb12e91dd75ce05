"""MXFP8 pages through SGLang's real L3 backends, byte for byte.

``file`` is SGLang's ``HiCacheFile`` on a temporary directory; ``mooncake`` is
SGLang's ``MooncakeStore`` against a real master and a separate storage node on
loopback (the ``mooncake`` fixture), so every byte crosses Mooncake's TCP
transport; ``dynamic`` and ``dynamic_v1`` are the in-test classes of
``dict_l3_backend`` loaded by SGLang's factory from their module path, through
its generic and its zero-copy page functions. Pages move through
``tools.l3.StoragePageIO``: the backend built by SGLang's factory and the cache
controller's own page functions (its hit query: ``hit_query``). The plugin's
storage hooks are applied for each test as ``HookRegistry`` applies them.

The stored page is the host page (``page.HostPage``): one span of the pool's
``kv_buffer``, the K part (every layer's payload run then scale run) followed
by the V part. Host pages hold random bytes; pages go to L3 from one permuted
set of host pages and come back into another, and every host page outside the
fetch must keep its bytes. Test ids name the backend and the planted fault.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import uuid
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import chunked, guards, releases, seal, sealed, storage
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.guards import Guard
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.page import PART_ALIGN, STORAGE_FORMAT_VERSION, PagePart
from sglang_mxfp8_hicache.tools.l3 import (
    LOCAL_BACKENDS,
    StoragePageIO,
    local_backend,
    page_hashes,
    sglang_backend,
)
from sglang_mxfp8_hicache.tools.pools import (
    PAGE_SIZE,
    build_device_pool,
    build_host_pool,
    fill_random,
    host_page_rows,
    page_token_indices,
)
from testkit import dict_l3_backend
from testkit import metrics as counted

on_cpu = pytest.mark.parametrize("device", ["cpu"], indirect=True)


@pytest.fixture
def storage_hooks(monkeypatch):
    """The plugin's storage hook, wrapped by HookRegistry's own AROUND wrapper,
    for this test only (HookRegistry itself patches for the whole process)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    create = StorageBackendFactory.__dict__["create_backend"].__func__
    monkeypatch.setattr(
        StorageBackendFactory,
        "create_backend",
        classmethod(_wrap_fn(create, storage.guard_storage_backend, HookType.AROUND)),
    )


def hit_query(io: StoragePageIO, tokens: list[int]) -> list[str]:
    """The keys of the leading pages of ``tokens`` that L3 holds, as the
    controller's ``_storage_hit_query`` finds them."""
    from sglang.srt.managers.cache_controller import (
        HiCacheController,
        PrefetchOperation,
    )

    hashes, _ = HiCacheController._storage_hit_query(
        io, PrefetchOperation("query", tokens)
    )
    return hashes


@pytest.fixture(
    params=["file", "mooncake", "dynamic", "dynamic_v1", "hf3fs", "nixl", "seaweedfs"]
)
def backend(request, tmp_path, monkeypatch, storage_hooks):
    """(backend name, extra config) of a live backend: ``tools.l3.local_backend``
    for file, hf3fs and nixl (in a directory of the test)."""
    if request.param in LOCAL_BACKENDS:
        if request.param == "hf3fs":
            # It installs process-wide SIGINT/SIGTERM/SIGQUIT handlers that
            # only close it; pytest keeps its own.
            monkeypatch.setattr(signal, "signal", lambda *args: None)
        local = local_backend(request.param, str(tmp_path))
        with local.environment():
            yield request.param, local.extra_config
    elif request.param in ("mooncake", "seaweedfs"):
        service = request.getfixturevalue(request.param)
        yield request.param, service.extra_config()
    else:
        yield "dynamic", dict_l3_backend.extra_config(v1=request.param == "dynamic_v1")
        dict_l3_backend.FAULTS.clear()


@pytest.fixture
def open_io(backend):
    """Opens a backend on a pool under a model name unique to the test: the
    Mooncake store lives for the whole session, and keeps what it was given."""
    name, extra_config = backend
    model = f"model-{uuid.uuid4().hex[:8]}"
    opened = []

    def open_(pool, model_name: str = model) -> StoragePageIO:
        io = StoragePageIO.open(
            name, pool, model_name=model_name, extra_config=extra_config
        )
        opened.append(io)
        return io

    open_.backend_name = name
    yield open_
    for io in opened:
        io.close()


def host_pages(host, pages: torch.Tensor) -> torch.Tensor:
    """Copies of ``pages``' host bytes, page first: our pool's (pages, span)
    rows, or the (pages, K/V, bytes) rows of SGLang's page_first payload pool."""
    return host_page_rows(host)[pages].clone()


def fill_host(host, seed: int) -> None:
    fill_random([host_page_rows(host)], torch.Generator().manual_seed(seed))


def page_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.view(torch.uint8).numpy().tobytes()


class Stored:
    """``pages`` random host pages backed up to L3 under random tokens, then every
    host byte overwritten: what ``fetch`` must bring back into other pages.

    With ``reader``, another pool's backend fetches them into its own pages
    (after the same overwrite), under the same keys.
    """

    def __init__(
        self,
        io: StoragePageIO,
        *,
        pages: int,
        seed: int = 0,
        reader: StoragePageIO | None = None,
    ):
        writer = io.storage_host_pool
        self.io = reader or io
        self.host = host = self.io.storage_host_pool
        gen = torch.Generator().manual_seed(seed)
        fill_host(writer, seed)
        self.src = torch.randperm(writer.page_num, generator=gen)[:pages]
        self.dst = torch.randperm(host.page_num, generator=gen)[:pages]
        self.tokens = torch.randint(
            0, 1 << 20, (pages * PAGE_SIZE,), generator=gen
        ).tolist()
        self.hashes = page_hashes(self.tokens, PAGE_SIZE)
        assert io.backup(self.hashes, page_token_indices(self.src))
        # After the backup: a backend that needs seals has them written then.
        self.saved = host_pages(writer, self.src)
        fill_host(writer, seed + 1)
        if host is not writer:
            fill_host(host, seed + 2)
        self.before = host_pages(host, torch.arange(host.page_num))

    def fetch(self) -> int:
        return self.io.fetch(self.hashes, page_token_indices(self.dst))

    def check(self, arrived: int, *, misses_kept: bool = True) -> None:
        """Host pages ``dst[:arrived]`` hold what was saved, every byte of their
        span; every other host page kept its bytes, those of the pages that did
        not arrive included unless ``misses_kept`` is False (a zero-copy
        dynamic class writes the prefetch's pages before its reply is judged)."""
        now = host_pages(self.host, torch.arange(self.host.page_num))
        kept = torch.ones(self.host.page_num, dtype=torch.bool)
        kept[self.dst[: arrived if misses_kept else len(self.dst)]] = False
        assert torch.equal(now[self.dst[:arrived]], self.saved[:arrived]), (
            "an arrived page differs from the page saved"
        )
        assert torch.equal(now[kept], self.before[kept]), (
            "a host page outside the fetch changed"
        )


# -- the page format, without a backend ------------------------------------------


@on_cpu
def test_flat_page_is_the_zero_copy_parts_concatenated(make_pools):
    """get_data_page is a view of the page's span in kv_buffer (no copy), and,
    byte for byte, what get_page_buffer_meta points at: the K part then the V
    part, flat ints as SGLang's own pools give them, each inside the one buffer
    of get_hybrid_pool_buffer (what a zero-copy backend registers)."""
    _, host = make_pools(heads=8, head_dim=128, layers=3, pages=6)
    fill_host(host, 3)
    page = host.host_page
    # Per layer: 128 tokens x 8 heads x 128 fp8, and 8 heads x 4 scales per token.
    assert (
        page.k_part
        == page.v_part
        == PagePart(PAGE_SIZE * 8 * 128, 8 * 4 * PAGE_SIZE, 3, seal_bytes=PART_ALIGN)
    )
    k_span = page.k_part.span_bytes
    assert page.span_bytes == 2 * k_span
    assert tuple(host.kv_buffer.shape) == (host.page_num, page.span_bytes)
    [buffer] = host.get_hybrid_pool_buffer()
    assert buffer is host.kv_buffer
    lo = buffer.data_ptr()
    hi = lo + buffer.numel() * buffer.element_size()

    pages = torch.tensor([4, 0, 2])
    ptrs, sizes = host.get_page_buffer_meta(page_token_indices(pages))
    assert all(type(x) is int for x in (*ptrs, *sizes))
    assert sizes == [k_span, k_span] * len(pages)
    for n, p in enumerate(pages.tolist()):
        k_ptr, v_ptr = ptrs[2 * n : 2 * n + 2]
        assert (k_ptr, v_ptr) == (
            lo + p * page.span_bytes,
            lo + p * page.span_bytes + k_span,
        )
        for ptr, size in zip((k_ptr, v_ptr), sizes[2 * n : 2 * n + 2], strict=True):
            assert lo <= ptr and ptr + size <= hi
        flat = host.get_data_page(p * PAGE_SIZE)
        parts = ctypes.string_at(k_ptr, k_span) + ctypes.string_at(v_ptr, k_span)
        assert parts == page_bytes(flat) == page_bytes(host_page_rows(host)[p])
        # A view of kv_buffer's page: a byte written through it is the pool's.
        assert flat.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert flat.data_ptr() == k_ptr
        raw = flat.view(torch.uint8)
        raw[-1] = ~raw[-1]
        assert ctypes.string_at(v_ptr + k_span - 1, 1) == page_bytes(raw[-1:])
    assert host.get_page_buffer_element_size() == k_span
    dummy = host.get_dummy_flat_data_page()
    assert (dummy.dtype, dummy.numel()) == (host.dtype, page.span_bytes)


@on_cpu
@pytest.mark.parametrize("v_head_dim", [None, 64], ids=["symmetric", "asymmetric"])
def test_unflat_page_is_the_k_and_v_parts(make_pools, v_head_dim):
    """get_data_page(flat=False) is the span's K part and V part, views of the
    span: two rows of one (2, S) view when they are the same size, a tuple of
    two views of different sizes for asymmetric MXFP8 heads. They are the
    parts get_page_buffer_meta points at."""
    _, host = make_pools(
        heads=2, head_dim=128, layers=2, pages=4, v_head_dim=v_head_dim
    )
    fill_host(host, 4)
    k_span, v_span = host.host_page.k_part.span_bytes, host.host_page.v_part.span_bytes
    p = 3
    flat = host.get_data_page(p * PAGE_SIZE)
    parts = host.get_data_page(p * PAGE_SIZE, flat=False)
    if v_head_dim is None:
        assert k_span == v_span
        assert isinstance(parts, torch.Tensor)
        assert tuple(parts.shape) == (2, k_span)
        k, v = parts
    else:
        # Per layer: V payload 128 x 2 x 64 fp8, V scales 2 x 2 per token;
        # 2 layers of 16,896 B, then 3,072 B of seal area: 9 blocks of 4 KiB.
        assert host.host_page.v_part == PagePart(
            PAGE_SIZE * 2 * 64, 2 * 2 * PAGE_SIZE, 2, seal_bytes=3072
        )
        assert k_span > v_span
        assert isinstance(parts, tuple)
        k, v = parts
        assert (k.numel(), v.numel()) == (k_span, v_span)
    assert (k.data_ptr(), v.data_ptr()) == (flat.data_ptr(), flat.data_ptr() + k_span)
    assert page_bytes(k) + page_bytes(v) == page_bytes(flat)
    ptrs, sizes = host.get_page_buffer_meta(page_token_indices(torch.tensor([p])))
    assert (ptrs, sizes) == ([k.data_ptr(), v.data_ptr()], [k_span, v_span])
    # Views: a byte written through the V part is the pool's.
    v.view(torch.uint8)[0] = ~v.view(torch.uint8)[0]
    assert page_bytes(host_page_rows(host)[p, k_span : k_span + 1]) == page_bytes(v[:1])


@on_cpu
def test_element_size_through_a_host_pool_group(make_pools):
    """SGLang's HostPoolGroup (what the assemblers build) asks its anchor for the
    element size: SGLang's default, the first size of get_page_buffer_meta, the
    K part's span. Only a heads-major (page_head) page splits by heads: then
    the element is one head group's K bytes."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    device_pool, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    group = HostPoolGroup(
        [
            PoolEntry(
                PoolName.KV,
                host,
                device_pool,
                lambda i: i,
                is_primary_index_anchor=True,
            )
        ]
    )
    assert group.get_page_buffer_element_size() == host.host_page.k_part.span_bytes
    with pytest.raises(
        NotImplementedError, match="only with --hicache-mem-layout page_head"
    ):
        group.get_page_buffer_element_size(2)
    device_pool, heads_major = make_pools(
        heads=2, head_dim=128, layers=2, pages=2, layout="page_head"
    )
    group = HostPoolGroup(
        [
            PoolEntry(
                PoolName.KV,
                heads_major,
                device_pool,
                lambda i: i,
                is_primary_index_anchor=True,
            )
        ]
    )
    k_head, _ = heads_major.host_page.head_span_bytes()
    assert group.get_page_buffer_element_size(2) == k_head


@on_cpu
def test_flat_page_round_trip_and_wrong_size(make_pools):
    """A flat page set into another page is that page's span, and no other page
    changes; a page of another size is refused before a byte is written."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=4)
    fill_host(host, 5)
    before = host_pages(host, torch.arange(host.page_num))
    page = host.get_dummy_flat_data_page()
    page.copy_(host.get_data_page(2 * PAGE_SIZE))
    host.set_from_flat_data_page(0, page)
    after = host_pages(host, torch.arange(host.page_num))
    assert torch.equal(after[0], before[2])
    assert torch.equal(after[1:], before[1:])
    for wrong in (page[:-1], torch.cat([page, page[:1]])):
        with pytest.raises(ValueError, match="flat page of"):
            host.set_from_flat_data_page(PAGE_SIZE, wrong)
    assert torch.equal(host_pages(host, torch.arange(host.page_num)), after)
    with pytest.raises(ValueError, match="not a page start"):
        host.get_data_page(5)
    with pytest.raises(ValueError, match="not a page start"):
        host.set_from_flat_data_page(5, page)
    with pytest.raises(ValueError, match="L3 page index 5 is not a page start"):
        host.get_page_buffer_meta(torch.arange(5, 5 + 2 * PAGE_SIZE))


@on_cpu
def test_format_tag_names_format_version_and_geometry(make_pools):
    """Every number that fixes a page's bytes is in the key tag: layers, heads,
    head dims (V's when it differs), page size, and the page format version."""

    def tag(heads, head_dim, v_head_dim, layers):
        _, host = make_pools(
            heads=heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            layers=layers,
            pages=2,
        )
        return host.storage_format_tag

    tags = {
        tag(*geometry)
        for geometry in (
            (2, 128, None, 2),
            (1, 256, None, 2),
            (2, 128, None, 3),
            (4, 128, None, 2),
            (2, 128, 64, 2),
        )
    }
    assert len(tags) == 5
    assert STORAGE_FORMAT_VERSION == 4
    assert "mxfp8v4-l2h2d128p128" in tags
    assert "mxfp8v4-l2h2d128v64p128" in tags


# -- round trips and faults through the real backends ----------------------------


@pytest.mark.parametrize("pages", [1, 5, 130], ids=lambda p: f"{p}pages")
def test_round_trip(device, make_pools, open_io, pages):
    """130 pages: two controller batches of at most 128."""
    _, host = make_pools(heads=8, head_dim=128, layers=3, pages=pages)
    stored = Stored(open_io(host), pages=pages, seed=pages)
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    assert stored.fetch() == pages
    stored.check(pages)


@on_cpu
def test_guard_sets_only_its_inner_calls_on_the_backend(device, make_pools, open_io):
    """The backend SGLang built stays as it built it, but for the calls
    between its own methods that its row of ``storage.BACKENDS`` names: the
    guard in front of it is a plain object that reads the backend's
    attributes as they are."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    stored = Stored(open_io(host), pages=2, seed=3)
    assert stored.fetch() == 2
    guard = stored.io.storage_backend
    backend = sglang_backend(guard)
    name = stored.io.backend_name
    served = storage.BACKENDS[name]
    if served.guard is None:
        assert guard is backend
        return
    assert type(guard) is served.guard and backend is not guard
    ours = {
        attr
        for attr, value in vars(backend).items()
        if isinstance(getattr(getattr(value, "func", value), "__self__", None), Guard)
    }
    assert ours == set(served.inner_calls or ()), name
    backend.__dict__["_read_through_the_guard"] = 7
    assert guard._read_through_the_guard == 7


def test_prefixed_lookups_inside_the_backend():
    """``batch_exists_v2`` of a key-prefixed backend finds KV pages through
    its own ``batch_exists``: that call takes the prefix (once, whoever
    calls), the keys the v2 call was given do not."""

    class Backend:
        def batch_exists(self, keys, extra_info=None):
            return list(keys)

        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            return list(keys), self.batch_exists(keys)

    backend = Backend()
    pool = SimpleNamespace(storage_format_tag="tag")
    settings = SimpleNamespace(seal_threads=1, l3_chunk_pages=0)
    guard = guards.SealedGuard(
        backend, pool, settings, ("batch_exists",), prefix="tag_"
    )
    assert guard.batch_exists(["a"]) == ["tag_a"]
    assert guard.batch_exists_v2(["a"]) == (["a"], ["tag_a"])
    info = SimpleNamespace(prefix_keys=["p"])
    backend.batch_exists = guard.inner_batch_exists.__get__(guard)
    assert guard.inner_batch_exists(
        lambda keys, i: (keys, i.prefix_keys), ["a"], info
    ) == (
        ["tag_a"],
        ["tag_p"],
    )
    assert info.prefix_keys == ["p"]


def test_prefixed_backend_seals_under_the_controllers_key():
    """A key-prefixed backend stores a page under the prefixed key, sealed
    under the controller's key: the seal a page carries does not depend on
    the prefix."""
    stored = {}

    class Backend:
        def batch_set(self, keys, values):
            stored.update(zip(keys, values, strict=True))
            return True

    host_page = SimpleNamespace(k_part=SimpleNamespace(span_bytes=4096))
    pool = SimpleNamespace(host_page=host_page, storage_format_tag="tag")
    settings = SimpleNamespace(seal_threads=1, l3_chunk_pages=0)
    guard = guards.SealedGuard(Backend(), pool, settings, prefix="tag_")
    page = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    assert guard.batch_set(["abc"], [page])
    [(key, value)] = stored.items()
    data, seed = value.numpy(), seal.key_seed("tag", "abc")
    assert key == "tag_abc"
    assert seal.holds(data[:4096], seed) and seal.holds(data[4096:], seed)


def test_mooncake_read_of_a_shorter_object_is_not_a_read():
    """Every zero-copy read of Mooncake goes through the length check: it
    returns the bytes it read per object and SGLang takes any count above 0
    as read, so a shorter object comes back as the guard's WRONG_LENGTH;
    whole objects and Mooncake's own errors pass as they are, buffers split
    over several pointers count their sum."""
    counts = [100, 60, guards.MOONCAKE_OBJECT_NOT_FOUND, 30]
    store = SimpleNamespace(_get_batch_zero_copy_impl=lambda keys, ptrs, sizes: counts)
    guards.MooncakeGuard(store, None, None, ("_get_batch_zero_copy_impl",))
    sizes = [100, 100, 100, [10, 20]]
    got = store._get_batch_zero_copy_impl(list("abcd"), [0] * 4, sizes)
    assert got == [100, guards.WRONG_LENGTH, guards.MOONCAKE_OBJECT_NOT_FOUND, 30]


@on_cpu
@pytest.mark.parametrize("backend", ["hf3fs", "nixl"], indirect=True)
def test_sglang_failure_injector_wraps_the_guard(
    device, make_pools, open_io, monkeypatch
):
    """With SGLang's test injector on, it is built around the guard: what it
    fails, the guard sees as a backend's failure. (Backends with a ``close``:
    the injector's calls it whether the backend has one or not.)"""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0")
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    stored = Stored(open_io(host), pages=2, seed=4)
    injector = stored.io.storage_backend
    assert isinstance(injector, HiCacheStorageFailureInjector)
    assert isinstance(injector._backend, guards.Guard)
    assert stored.fetch() == 2
    stored.check(2)


@pytest.mark.parametrize("kv_cache_dtype", ["fp4_mx_block16", "nvfp4"])
def test_round_trip_fp4(device, make_pools, open_io, kv_cache_dtype):
    """FP4 pages: the same page format, payload at its real width, tagged by recipe."""
    _, host = make_pools(
        heads=8, head_dim=128, layers=3, pages=5, kv_cache_dtype=kv_cache_dtype
    )
    assert host.storage_format_tag.startswith(f"{kv_cache_dtype}v4-l3h8d128p128")
    # Per layer: 128 tokens x 8 heads x 64 bytes of FP4, and 8 scale bytes per head.
    assert (
        host.host_page.k_part
        == host.host_page.v_part
        == PagePart(128 * 8 * 64, 128 * 8 * 8, 3, seal_bytes=PART_ALIGN)
    )
    assert host.kv_buffer.dtype == torch.uint8
    stored = Stored(open_io(host), pages=5, seed=7)
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    assert stored.fetch() == 5
    stored.check(5)


def test_round_trip_asymmetric_heads(device, make_pools, open_io):
    """K head_dim 128, V head_dim 64 (MXFP8): the K and V parts differ in size,
    and the page comes back whole, both parts, under its own tag."""
    _, host = make_pools(heads=2, head_dim=128, v_head_dim=64, layers=3, pages=5)
    if open_io.backend_name == "hf3fs":  # slots of the K part's size
        with pytest.raises(BlockScaledHiCacheConfigError, match="head dims differ"):
            open_io(host)
        return
    assert host.storage_format_tag == "mxfp8v4-l3h2d128v64p128"
    k, v = host.host_page.k_part, host.host_page.v_part
    assert k.span_bytes - k.seal_bytes == 2 * (v.span_bytes - v.seal_bytes)
    stored = Stored(open_io(host), pages=5, seed=13)
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    assert stored.fetch() == 5
    stored.check(5)


@on_cpu
@pytest.mark.parametrize("backend", ["file", "hf3fs", "nixl"], indirect=True)
@pytest.mark.parametrize(
    "writer, reader",
    [
        ("layer_first", "layer_first"),
        ("page_first", "layer_first"),
        ("layer_first", "page_first_direct"),
    ],
    ids=lambda layout: layout,
)
def test_layer_first_pool_round_trips(make_pools, open_io, writer, reader):
    """The factory hook gives a layer_first pool its backend (the host page is
    the same span in every layout), and its pages come back byte for byte;
    under one model name, pages one layout stored load into a pool of another
    (hf3fs and nixl store a layer_first page as one flat object, a page_first
    one as two parts: one layout's pages are a miss for the other there)."""
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    pools = {
        layout: make_pools(heads=4, head_dim=128, layers=2, pages=5, layout=layout)[1]
        for layout in dict.fromkeys((writer, reader))
    }
    assert pools[writer].storage_format_tag == pools[reader].storage_format_tag
    ios = {layout: open_io(pool, model) for layout, pool in pools.items()}
    assert ios[reader].storage_backend.mem_pool_host is pools[reader]
    stored = Stored(ios[writer], pages=5, seed=17, reader=ios[reader])
    if writer != reader and open_io.backend_name != "file":
        assert hit_query(stored.io, stored.tokens) == []
        assert stored.fetch() == 0
        stored.check(0)
        return
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    assert stored.fetch() == 5
    stored.check(5)


@on_cpu
@pytest.mark.parametrize(
    "theirs, ours",
    [("nvfp4", "fp4_mx_block16"), ("fp4_mx_block16", "nvfp4"), ("nvfp4", "mxfp8")],
    ids=lambda f: f"wrong_format-{f}",
)
def test_pages_of_another_recipe_never_load(make_pools, open_io, theirs, ours):
    """Same model, same tokens: nvfp4 and fp4_mx_block16 pages of one geometry
    have the same bytes per page, and only the key tag tells them apart. Our
    host pages keep their bytes."""
    _, their_host = make_pools(
        heads=2, head_dim=128, layers=2, pages=4, kv_cache_dtype=theirs
    )
    _, our_host = make_pools(
        heads=2, head_dim=128, layers=2, pages=4, kv_cache_dtype=ours
    )
    if ours != "mxfp8":
        assert their_host.host_page.span_bytes == our_host.host_page.span_bytes
    # One model name for both pools, and for this test only: the Mooncake
    # store outlives the test.
    model = f"shared-{uuid.uuid4().hex[:8]}"
    stored = Stored(open_io(their_host, model), pages=3)
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    mine = open_io(our_host, model)
    assert hit_query(mine, stored.tokens) == []
    fill_host(our_host, 8)
    before = host_pages(our_host, torch.arange(our_host.page_num))
    assert mine.fetch(stored.hashes, page_token_indices(torch.arange(3))) == 0
    assert torch.equal(host_pages(our_host, torch.arange(our_host.page_num)), before)


def test_mooncake_pointers_lie_in_registered_buffers(
    make_pools, storage_hooks, mooncake, monkeypatch
):
    """Mooncake's TCP transport moves unregistered memory without a word, and RDMA
    would fail: the pool registers its one allocation, kv_buffer, and every part
    a page names lies in it."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeBaseStore,
    )

    registered = []
    register = MooncakeBaseStore.register_buffer

    def spy(self, tensor):
        registered.append(
            (
                tensor.data_ptr(),
                tensor.data_ptr() + tensor.numel() * tensor.element_size(),
            )
        )
        return register(self, tensor)

    monkeypatch.setattr(MooncakeBaseStore, "register_buffer", spy)
    _, host = make_pools(heads=8, head_dim=128, layers=2, pages=6)
    io = StoragePageIO.open(
        "mooncake",
        host,
        model_name=f"m-{uuid.uuid4().hex[:8]}",
        extra_config=mooncake.extra_config(),
    )
    buffer = host.kv_buffer
    assert registered == [
        (buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size())
    ]
    stored = Stored(io, pages=6)
    ptrs, sizes = host.get_page_buffer_meta(page_token_indices(stored.dst))
    assert len(ptrs) == len(sizes) == 2 * 6
    for ptr, size in zip(ptrs, sizes, strict=True):
        assert any(lo <= ptr and ptr + size <= hi for lo, hi in registered)
    assert stored.fetch() == 6
    stored.check(6)


def _file_path(io: StoragePageIO, key: str) -> str:
    return guards.file_page_path(io.storage_backend, key)


def _mooncake_keys(io: StoragePageIO, key: str) -> tuple[str, str]:
    backend = io.storage_backend
    [tagged] = backend._tag_keys([key])
    return f"{tagged}_{backend.mha_suffix}_k", f"{tagged}_{backend.mha_suffix}_v"


def _dict_key(io: StoragePageIO, key: str) -> str:
    """The key of ``dict_l3_backend.STORE`` for a page: ours carry the format tag."""
    tag = io.storage_host_pool.storage_format_tag
    return io.storage_backend.store_key(f"{tag}_{key}")


def _plant_hf3fs(io: StoragePageIO, key: str, fault: str) -> None:
    """hf3fs keeps a page's K and V parts in fixed slots of one file:
    ``missing`` forgets its keys, ``other_page`` copies another page's slots
    over its own (what a writer of another geometry sharing the file does)."""
    backend = io.storage_backend
    tag = io.storage_host_pool.storage_format_tag
    parts = [f"{tag}_{key}-k", f"{tag}_{key}-v"]
    metadata = backend.metadata_client
    if fault == "missing":
        metadata.delete_keys(backend.rank, parts)
        return
    slots = metadata.get_page_indices(backend.rank, parts)
    other = [i for i in range(slots[0] + 2, slots[0] + 6, 2) if i not in slots][0]
    size = backend.bytes_per_page
    with open(backend.file_path, "r+b") as f:
        for slot, source in zip(slots, (other, other + 1), strict=True):
            f.seek(source * size)
            data = f.read(size)
            f.seek(slot * size)
            f.write(data)


def _plant_nixl(io: StoragePageIO, key: str, fault: str, other: str) -> None:
    """NIXL keeps a page's K and V parts in two files (page_first):
    ``stale_tail`` overwrites the first half of the K file in place, as a
    smaller object rewritten under the key does (NIXL opens without O_TRUNC);
    ``other_page`` copies page ``other``'s files over its own (a page nothing
    plants: two planted pages copying each other would end as they began)."""
    backend = io.storage_backend
    [k_path, v_path] = guards.nixl_page_paths(backend, [key])
    if fault == "missing":
        os.remove(k_path)
        os.remove(v_path)
        return
    size = os.path.getsize(k_path)
    if fault == "other_page":
        other_paths = guards.nixl_page_paths(backend, [other])
        for source, target in zip(other_paths, (k_path, v_path), strict=True):
            with open(source, "rb") as f, open(target, "wb") as g:
                g.write(f.read())
        return
    if fault == "stale_tail":
        with open(k_path, "r+b") as f:
            f.write(os.urandom(size // 2))
        return
    new_size = {"truncated": size - 1, "longer": size + 64}[fault]
    with open(k_path, "wb") as f:
        f.write(os.urandom(new_size))


def _plant_seaweedfs(io: StoragePageIO, key: str, fault: str) -> None:
    """SeaweedFS keeps a page as one object (K part then V part)."""
    backend = io.storage_backend
    target = {"Bucket": backend.config.bucket, "Key": backend._object_key(key)}
    if fault == "missing":
        backend._s3.delete_object(**target)
        return
    size = backend._s3.head_object(**target)["ContentLength"]
    new_size = {"truncated": size - 1, "longer": size + 64, "other_geometry": 2 * size}
    backend._s3.put_object(**target, Body=os.urandom(new_size[fault]))


def _plant_dynamic(io: StoragePageIO, key: str, fault: str) -> None:
    """The in-test backends keep a page as one object in ``STORE``."""
    store_key = _dict_key(io, key)
    if fault == "missing":
        del dict_l3_backend.STORE[store_key]
        return
    size = len(dict_l3_backend.STORE[store_key])
    if fault == "other_page":  # a stale or foreign object of the right size
        others = [k for k in dict_l3_backend.STORE if k != store_key]
        dict_l3_backend.STORE[store_key] = dict_l3_backend.STORE[others[0]]
        return
    new_size = {
        "truncated": size - 64,
        "short_by_one": size - 1,
        "longer": size + 64,
        "other_geometry": 2 * size,
    }
    dict_l3_backend.STORE[store_key] = os.urandom(new_size[fault])


def _plant_file(io: StoragePageIO, key: str, fault: str) -> None:
    """``file`` keeps a page as one file."""
    path = _file_path(io, key)
    if fault == "missing":
        os.remove(path)
        return
    size = os.path.getsize(path)
    new_size = {"truncated": size - 1, "longer": size + 64, "other_geometry": 2 * size}
    with open(path, "wb") as f:
        f.write(os.urandom(new_size[fault]))


def _plant_mooncake(io: StoragePageIO, key: str, fault: str) -> None:
    """Mooncake keeps a page's K and V parts as two objects."""
    store = io.storage_backend.store
    k_key, v_key = _mooncake_keys(io, key)
    if fault == "missing_part":
        assert store.remove(v_key, True) == 0
        return
    replaced = [k_key, v_key] if fault == "other_geometry" else [k_key]
    for object_key in replaced:
        size = store.get_size(object_key)
        assert store.remove(object_key, True) == 0
        new_size = {
            "truncated": size - 1,
            "longer": size + 64,
            "other_geometry": 2 * size,
        }
        assert store.put(object_key, os.urandom(new_size[fault])) == 0


def _flipped_offset(io: StoragePageIO, where: str) -> int:
    """Where in a stored page's K part the ``flipped_*`` faults flip a byte:
    in the last layer's payload or scales, in the seal area before the seal
    (no device page holds it, the digest covers it), or in the seal's digest."""
    part = io.storage_host_pool.host_page.k_part
    last = part.layer_num - 1
    return {
        "payload": part.payload_offset(last) + 5,
        "scales": part.scale_offset(last) + 1,
        "seal_area": part.span_bytes - part.seal_bytes + 16,
        "seal": part.span_bytes - 4,
    }[where]


def _flip(io: StoragePageIO, key: str, where: str) -> None:
    """One bit of one byte of the page stored under ``key`` flipped in place,
    at ``_flipped_offset``, in the store of a sealed backend."""
    offset = _flipped_offset(io, where)
    backend = io.storage_backend
    if io.backend_name == "nixl":
        path, start = guards.nixl_page_paths(backend, [key])[0], 0
    elif io.backend_name == "hf3fs":
        tag = io.storage_host_pool.storage_format_tag
        [slot] = backend.metadata_client.get_page_indices(
            backend.rank, [f"{tag}_{key}-k"]
        )
        path, start = backend.file_path, slot * backend.bytes_per_page
    else:  # the in-test dynamic backends: one object, the K part first
        store_key = _dict_key(io, key)
        data = bytearray(dict_l3_backend.STORE[store_key])
        data[offset] ^= 0x01
        dict_l3_backend.STORE[store_key] = bytes(data)
        return
    with open(path, "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)[0]
        f.seek(start + offset)
        f.write(bytes([byte ^ 0x01]))


def _plant(io: StoragePageIO, key: str, fault: str, other: str = "") -> None:
    """Replace what L3 holds for ``key``: ``truncated`` / ``longer`` by a byte /
    64 bytes (the K object on Mooncake), ``other_geometry`` a page of twice the
    heads (both objects), ``missing`` the page, ``missing_part`` its V object,
    ``other_page`` another page's (NIXL: page ``other``'s); ``flipped_payload``
    / ``_scales`` / ``_seal_area`` / ``_seal`` one bit of the K part (``_flip``)."""
    if fault.startswith("flipped_"):
        _flip(io, key, fault.removeprefix("flipped_"))
        return
    if io.backend_name == "nixl":
        _plant_nixl(io, key, fault, other)
        return
    plant = {
        "hf3fs": _plant_hf3fs,
        "seaweedfs": _plant_seaweedfs,
        "dynamic": _plant_dynamic,
        "file": _plant_file,
    }.get(io.backend_name, _plant_mooncake)
    plant(io, key, fault)


FAULTS = [
    ("file", "truncated"),
    ("file", "longer"),
    ("file", "other_geometry"),
    ("file", "missing"),
    ("mooncake", "truncated"),
    ("mooncake", "longer"),
    ("mooncake", "other_geometry"),
    ("mooncake", "missing_part"),
    ("dynamic", "truncated"),
    ("dynamic", "longer"),
    ("dynamic", "other_geometry"),
    ("dynamic", "missing"),
    ("dynamic_v1", "truncated"),
    ("dynamic_v1", "missing"),
    ("hf3fs", "other_page"),
    ("hf3fs", "missing"),
    ("nixl", "truncated"),
    ("nixl", "longer"),
    ("nixl", "stale_tail"),
    ("nixl", "other_page"),
    ("nixl", "missing"),
    ("seaweedfs", "truncated"),
    ("seaweedfs", "longer"),
    ("seaweedfs", "other_geometry"),
    ("seaweedfs", "missing"),
    # A single flipped bit, on every sealed backend (storage.BACKENDS).
    *(
        (backend, f"flipped_{where}")
        for backend in ("nixl", "hf3fs", "dynamic", "dynamic_v1")
        for where in ("payload", "scales", "seal_area", "seal")
    ),
]


MISS_REASONS = {
    "other_page": "seal_mismatch",
    "stale_tail": "seal_mismatch",
    "missing_part": "part_missing",
    "mooncake-longer": "read_error",
    "mooncake-other_geometry": "read_error",
    "dynamic_v1-truncated": "seal_mismatch",
    "nixl-longer": "seal_mismatch",
}
"""The reason a planted fault is counted under: a flipped bit, another page
or a stale tail fails its seal, a part missing is one; Mooncake refuses to
read a longer object into its buffer (an error code); where a backend reads
into the host page without a size (``dynamic_v1``, NIXL past a page's end)
the seal finds it; else the size is wrong."""


@pytest.mark.parametrize(
    "backend, fault",
    FAULTS,
    indirect=["backend"],
    ids=[f"{b}-{f}" for b, f in FAULTS],
)
def test_bad_page_is_a_miss(make_pools, open_io, backend, fault, caplog):
    """Pages 2 and 3 of 6 are bad: 2 pages arrive, the host pages of the others
    keep their bytes, and the batch logs once. A missing page or part is found
    by the hit query too; the fetch is made anyway, as when it goes between
    the query and the read."""
    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=6)
    stored = Stored(open_io(host), pages=6, seed=11)
    for key in stored.hashes[2:4]:
        _plant(stored.io, key, fault, other=stored.hashes[0])
    hits = hit_query(stored.io, stored.tokens)
    expected_hits = 2 if fault in ("missing", "missing_part") else 6
    assert hits == stored.hashes[:expected_hits]
    caplog.clear()
    before = counted.missed(host.pool_label)
    with caplog.at_level(logging.WARNING):
        arrived = stored.fetch()
    assert arrived == 2
    missed = counted.grown(before, counted.missed(host.pool_label))
    # Backends checked by seals read every page before it is judged, Mooncake's
    # lengths are checked on arrival, and SeaweedFS reads a batch's pages in
    # parallel, past a bad one: into the prefetch's own host pages, which
    # SGLang frees past the last that arrived.
    past_a_miss = stored.io.zero_copy and backend[0] in (
        *(name for name, served in storage.BACKENDS.items() if served.sealed),
        "mooncake",
        "seaweedfs",
    )
    stored.check(2, misses_kept=not past_a_miss)
    ours = [r.getMessage() for r in caplog.records if r.name == sealed.__name__]
    if fault == "missing" or backend[0] == "seaweedfs":
        # The backend's miss, logged by SGLang (SeaweedFS checks sizes itself).
        assert ours == [] and missed == {}
    else:
        [line] = ours
        assert "2 of 6 pages in this batch are missing a part or have the wrong" in line
        # Pages 2 and 3 by their fault, pages 4 and 5 behind them.
        flipped = fault.startswith("flipped_")
        name = backend[0] + ("_v1" if "interface_v1" in (backend[1] or {}) else "")
        reason = MISS_REASONS.get(f"{name}-{fault}", MISS_REASONS.get(fault))
        reason = "seal_mismatch" if flipped else reason or "wrong_size"
        assert missed == {reason: 2, "behind_a_miss": 2}, missed


@pytest.mark.parametrize(
    "backend", ["nixl", "hf3fs", "dynamic", "dynamic_v1"], indirect=True
)
def test_bad_page_in_a_later_chunk_is_a_miss(
    make_pools, open_io, backend, caplog, monkeypatch
):
    """With chunks of at least 4 pages, a sealed batch of 20 pages moves in
    chunks of 10, 5 and 5, each checked while the next is read
    (``chunked.py``): page 12, in the second chunk, has one flipped payload
    bit. 12 pages arrive, byte for byte, the batch logs once, and no host
    page outside the fetch changes."""
    monkeypatch.setenv("SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES", "4")
    assert chunked.chunk_bounds(20, 4) == [(0, 10), (10, 15), (15, 20)]
    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=20)
    stored = Stored(open_io(host), pages=20, seed=13)
    _plant(stored.io, stored.hashes[12], "flipped_payload")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        arrived = stored.fetch()
    assert arrived == 12
    stored.check(12, misses_kept=not stored.io.zero_copy)
    ours = [r.getMessage() for r in caplog.records if r.name == sealed.__name__]
    [line] = ours
    assert "1 of 20 pages in this batch" in line and "unsealed" in line


@on_cpu
@pytest.mark.parametrize("backend", ["dynamic_v1"], indirect=True)
def test_chunks_are_read_and_written_with_their_prefix_keys(
    make_pools, open_io, backend, monkeypatch
):
    """With chunks of at least 4 pages, each chunk's call carries the
    batch's ``prefix_keys`` and the keys
    before the chunk, so that ``prefix_keys + keys`` stays one chain, as
    SGLang's own split calls keep it, every key with the format tag; a call
    without prefix keys keeps none, and the caller's extra info is left as
    it was."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    monkeypatch.setenv("SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES", "4")
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=20)
    calls = []
    store = dict_l3_backend.DictStoreV1
    for name in ("batch_get_v1", "batch_set_v1"):
        method = getattr(store, name)

        def recorded(self, keys, host_indices, extra_info=None, _m=method, _n=name):
            prefix = getattr(extra_info, "prefix_keys", None)
            calls.append((_n, list(keys), prefix))
            return _m(self, keys, host_indices, extra_info)

        monkeypatch.setattr(store, name, recorded)
    io = open_io(host)  # the guard binds the class's methods as it is built
    keys = [f"page{n}" for n in range(20)]
    indices = page_token_indices(torch.arange(20))
    backend_ = io.storage_backend
    info = HiCacheStorageExtraInfo(prefix_keys=["p0", "p1"])
    assert backend_.batch_set_v1(keys, indices, info) == [True] * 20
    assert backend_.batch_get_v1(keys, indices, info) == [True] * 20
    assert backend_.batch_get_v1(keys, indices, None) == [True] * 20
    tag = f"{host.storage_format_tag}_"
    for name, sizes in (("batch_set_v1", [5, 5, 10]), ("batch_get_v1", [10, 5, 5])):
        chunks = [(k, p) for n, k, p in calls if n == name][:3]
        assert [len(k) for k, _ in chunks] == sizes
        for chunk_keys, prefix in chunks:
            start = keys.index(chunk_keys[0].removeprefix(tag))
            assert prefix == [tag + key for key in ["p0", "p1", *keys[:start]]]
    assert [p for n, _, p in calls[-3:]] == [None] * 3
    assert info.prefix_keys == ["p0", "p1"]


dynamic_only = pytest.mark.parametrize(
    "backend", ["dynamic", "dynamic_v1"], indirect=True
)


@on_cpu
@dynamic_only
def test_dynamic_backend_error_is_a_miss(make_pools, open_io, backend, caplog):
    """A dynamic class that raises on a read: no page arrives, no host page
    changes, one warning, three pages counted as the backend's raise."""
    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=3)
    stored = Stored(open_io(host), pages=3, seed=5)
    dict_l3_backend.FAULTS.add("raise")
    before = counted.missed(host.pool_label)
    with caplog.at_level(logging.WARNING):
        assert stored.fetch() == 0
    stored.check(0)
    assert counted.grown(before, counted.missed(host.pool_label)) == {
        "backend_raised": 3
    }
    ours = [r.getMessage() for r in caplog.records if r.name == sealed.__name__]
    assert len(ours) == 1 and "dict store unreachable" in ours[0]


@on_cpu
@pytest.mark.parametrize("backend", ["dynamic", "hf3fs", "nixl"], indirect=True)
def test_sealed_backend_refuses_a_heads_major_page(make_pools, open_io, backend):
    """A page_head page has no seal to check these backends' reads by."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2, layout="page_head")
    with pytest.raises(
        BlockScaledHiCacheConfigError, match="heads-major page has none"
    ):
        open_io(host)


@on_cpu
@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_nixl_moves_whole_parts_with_and_without_o_direct(
    make_pools, storage_hooks, tmp_path, direct_io
):
    """Every part is whole 4 KiB blocks (here 3 layers of 16,896 B and a
    2,560 B seal area), so NIXL with O_DIRECT (SGLang's default) moves pages
    as buffered NIXL does: exact, each file a part (zero-copy: a pinned pool
    is 4 KiB aligned) or a page (NIXL's bounce buffers: this pool is not)."""
    _, host = make_pools(heads=1, head_dim=128, layers=3, pages=6)
    part = host.host_page.k_part
    assert (part.span_bytes, part.seal_bytes) == (13 * PART_ALIGN, 2560)
    local = local_backend("nixl", str(tmp_path))
    with local.environment():
        extra_config = local.extra_config | {"use_direct_io": direct_io}
        io = StoragePageIO.open("nixl", host, extra_config=extra_config)
        try:
            nixl = sglang_backend(io.storage_backend)
            assert nixl.needs_page_alignment == direct_io
            stored = Stored(io, pages=3, seed=9)
            assert stored.fetch() == 3
            stored.check(3)
            paths = guards.nixl_page_paths(nixl, stored.hashes)
            one_file = part if nixl.is_zero_copy else host.host_page
            assert {os.path.getsize(path) for path in paths} == {one_file.span_bytes}
        finally:
            io.close()


DYNAMIC_CUTS = [
    (backend, fault)
    for backend in ("dynamic", "dynamic_v1")
    for fault in ("short_by_one", "truncated", "longer", "other_page")
]


@on_cpu
@pytest.mark.parametrize(
    "backend, fault",
    DYNAMIC_CUTS,
    indirect=["backend"],
    ids=[f"{b}-{f}" for b, f in DYNAMIC_CUTS],
)
def test_dynamic_object_copied_into_the_page_is_a_miss(
    make_pools, open_io, backend, fault
):
    """A class that copies what it holds into the page as far as it fits and
    reports a hit (generic: into the staging page; v1: into the host page):
    an object a byte or 64 bytes short, 64 bytes longer, or another page's
    object under this key. Only the seal tells; page 1 is a miss."""
    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=4)
    stored = Stored(open_io(host), pages=4, seed=7)
    _plant(stored.io, stored.hashes[1], fault)
    dict_l3_backend.FAULTS.add("fill")
    assert stored.fetch() == 1
    stored.check(1, misses_kept=not stored.io.zero_copy)


@pytest.fixture
def bf16_host(cpu_kernels):
    device_pool = build_device_pool(
        head_num=2,
        head_dim=128,
        layer_num=2,
        pages=9,
        device="cpu",
        payload_dtype=torch.bfloat16,
    )
    host = build_host_pool(
        device_pool, MHATokenToKVPoolHost, host_to_device_ratio=1.0, pin_memory=False
    )
    yield host
    host.destroy()


@on_cpu
@pytest.mark.parametrize(
    "other", ["bf16", "other_geometry"], ids=lambda o: f"wrong_format-{o}"
)
def test_pages_of_another_format_never_load(make_pools, open_io, bf16_host, other):
    """Same model, same tokens: a bf16 page, or an MXFP8 page of another geometry
    with the same byte size (1x256 against 2x128), is not in L3 for our pool."""
    if other == "bf16":
        theirs = bf16_host
    else:
        _, theirs = make_pools(heads=1, head_dim=256, layers=2, pages=4)
    _, ours = make_pools(heads=2, head_dim=128, layers=2, pages=4)
    stored = Stored(open_io(theirs, "shared-model"), pages=3)
    assert hit_query(stored.io, stored.tokens) == stored.hashes
    mine = open_io(ours, "shared-model")
    assert hit_query(mine, stored.tokens) == []
    fill_host(ours, 9)
    before = host_pages(ours, torch.arange(ours.page_num))
    assert mine.fetch(stored.hashes, page_token_indices(torch.arange(3))) == 0
    assert torch.equal(host_pages(ours, torch.arange(ours.page_num)), before)


# -- which backends may see an MXFP8 pool ------------------------------------------

REFUSED = sorted(storage.REFUSED_STORAGE_BACKENDS)


@on_cpu
@pytest.mark.parametrize("name", REFUSED)
def test_factory_refuses_backend_by_name(make_pools, storage_hooks, name):
    """At startup and at runtime attach alike (both go through the factory),
    before the backend is built."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match=f"--hicache-storage-backend {name} cannot store mxfp8 pages",
    ):
        StoragePageIO.open(name, host)


def test_factory_leaves_other_pools_alone(bf16_host, storage_hooks, tmp_path):
    io = StoragePageIO.open(
        "file", bf16_host, extra_config={"file_storage_path": str(tmp_path)}
    )
    assert io.storage_backend.mem_pool_host is bf16_host
    with pytest.raises(Exception) as raised:  # SGLang's own: no EIC SDK here
        StoragePageIO.open("eic", bf16_host)
    assert not isinstance(raised.value, BlockScaledHiCacheConfigError)


@on_cpu
def test_mooncake_startup_allocator_round_trip(
    device, cpu_kernels, storage_hooks, mooncake
):
    """With --hicache-storage-backend mooncake at startup, SGLang builds the host
    pool with Mooncake's host allocator: the pool's one allocation, every page
    span, payload and scales, comes from it."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeHostTensorAllocator,
    )

    device_pool = build_device_pool(
        head_num=4, head_dim=128, layer_num=2, pages=9, device="cpu"
    )
    info = releases.device_buffer_info(device_pool)
    host = MHATokenToKVPoolMXFP8Host(
        info,
        1.0,
        0,
        PAGE_SIZE,
        "page_first",
        pin_memory=False,
        allocator_type="mooncake",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=1,
    )
    try:
        assert isinstance(host.allocator, MooncakeHostTensorAllocator)
        assert host.allocator.ptr == host.kv_buffer.data_ptr()
        assert tuple(host.kv_buffer.shape) == (host.page_num, host.host_page.span_bytes)
        io = StoragePageIO.open(
            "mooncake",
            host,
            model_name=f"m-{uuid.uuid4().hex[:8]}",
            extra_config=mooncake.extra_config(),
        )
        stored = Stored(io, pages=4, seed=21)
        assert stored.fetch() == 4
        stored.check(4)
        io.close()
    finally:
        host.destroy()


@on_cpu
def test_bad_page_is_a_miss_mooncake_backend_error(make_pools, storage_hooks, mooncake):
    """The storage node holding the pages dies after the hit query: every read
    fails inside Mooncake, nothing arrives, and no host byte changes."""
    import signal

    from testkit.mooncake_loopback import MooncakeLoopback

    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=4)
    with MooncakeLoopback() as service:
        io = StoragePageIO.open(
            "mooncake",
            host,
            model_name="backend-error",
            extra_config=service.extra_config(),
        )
        stored = Stored(io, pages=4, seed=31)
        assert hit_query(io, stored.tokens) == stored.hashes
        node = service.pids["node"]
        os.kill(node, signal.SIGKILL)
        os.waitpid(node, 0)
        assert stored.fetch() == 0
        stored.check(0)


@on_cpu
def test_page_head_head_groups_shared_across_tp_sizes(
    make_pools, storage_hooks, mooncake
):
    """page_head with a TP-LCM above the rank's TP size: a 4-head rank (TP 1 of
    LCM 2) stores each page as two head-group objects (mooncake's split heads),
    and the two 2-head ranks of TP 2 each load theirs as a whole page, byte for
    byte its half of the 4-head page."""
    common = dict(head_dim=128, layers=2, pages=3, layout="page_head")
    _, wide = make_pools(heads=4, **common)
    narrow = [make_pools(heads=2, **common)[1] for _ in range(2)]
    model = f"model-{uuid.uuid4().hex[:8]}"
    extra = mooncake.extra_config()
    writer = StoragePageIO.open(
        "mooncake", wide, model_name=model, extra_config=extra, tp_lcm_size=2
    )
    readers = [
        StoragePageIO.open(
            "mooncake",
            pool,
            model_name=model,
            extra_config=extra,
            tp_rank=rank,
            tp_size=2,
            tp_lcm_size=2,
        )
        for rank, pool in enumerate(narrow)
    ]
    try:
        assert writer.storage_backend.should_split_heads
        fill_host(wide, 21)
        src, dst = torch.tensor([2, 0]), torch.tensor([1, 3])
        tokens = torch.randint(0, 1 << 20, (2 * PAGE_SIZE,)).tolist()
        hashes = page_hashes(tokens, PAGE_SIZE)
        assert writer.backup(hashes, page_token_indices(src))
        k_head, v_head = wide.host_page.head_span_bytes()
        k_part = wide.host_page.k_part.span_bytes
        for rank, (reader, pool) in enumerate(zip(readers, narrow, strict=True)):
            fill_host(pool, 30 + rank)
            assert hit_query(reader, tokens) == hashes
            assert reader.fetch(hashes, page_token_indices(dst)) == 2
            got = host_page_rows(pool)[dst]
            spans = host_page_rows(wide)[src]
            k_group = spans[:, rank * 2 * k_head :][:, : 2 * k_head]
            v_group = spans[:, k_part + rank * 2 * v_head :][:, : 2 * v_head]
            assert torch.equal(got, torch.cat([k_group, v_group], dim=1)), rank
    finally:
        for io in (writer, *readers):
            io.close()


@on_cpu
def test_page_head_page_of_another_head_count_is_a_miss(
    make_pools, storage_hooks, mooncake
):
    """Heads-major tags name no head count, so a 4-head rank's whole page and a
    2-head rank share a Mooncake key (both rank 0, no split): the objects have
    another size, so it is a miss, and the 2-head host pages keep their bytes."""
    common = dict(head_dim=128, layers=2, pages=2, layout="page_head")
    _, wide = make_pools(heads=4, **common)
    _, narrow = make_pools(heads=2, **common)
    model = f"model-{uuid.uuid4().hex[:8]}"
    extra = mooncake.extra_config()
    writer = StoragePageIO.open("mooncake", wide, model_name=model, extra_config=extra)
    reader = StoragePageIO.open(
        "mooncake", narrow, model_name=model, extra_config=extra, tp_size=2
    )
    try:
        assert wide.storage_format_tag == narrow.storage_format_tag
        fill_host(wide, 41)
        tokens = torch.randint(0, 1 << 20, (PAGE_SIZE,)).tolist()
        hashes = page_hashes(tokens, PAGE_SIZE)
        assert writer.backup(hashes, page_token_indices(torch.tensor([1])))
        fill_host(narrow, 42)
        before = host_pages(narrow, torch.arange(narrow.page_num))
        assert reader.fetch(hashes, page_token_indices(torch.tensor([0]))) == 0
        assert torch.equal(host_pages(narrow, torch.arange(narrow.page_num)), before)
    finally:
        for io in (writer, reader):
            io.close()


# -- through SGLang's cache controller -------------------------------------------


@pytest.mark.parametrize(
    "l3", ["file", "hf3fs", "nixl", "seaweedfs", "mooncake", "dynamic", "dynamic_v1"]
)
def test_controller_attach_round_trip_detach(l3, request):
    """SGLang's admin path on the CPU (``test/e2e.py`` with the kernel
    emulations, in a fresh process): ``attach_storage_backend`` of a refused
    backend leaves the controller as it was; then the backend is attached,
    host pages go to L3 through the backup thread, are evicted and their host
    bytes overwritten, come back through the hit query and the prefetch
    thread, are loaded to the device (payload and scales exact, untouched
    pages kept), and the backend is detached. The pool's counters saw loads
    through device staging; on ``file``, the last page's file cut short and
    fetched again is one ``wrong_size`` miss."""
    from testkit.e2e_cpu import run_cpu

    name, config = l3, None
    if l3 in ("mooncake", "seaweedfs"):
        config = request.getfixturevalue(l3).extra_config()
    elif l3.startswith("dynamic"):
        name, config = "dynamic", dict_l3_backend.extra_config(v1=l3 == "dynamic_v1")
    [verdict] = run_cpu(["ours"], ["kv"], l3=name, l3_config=config).values()
    assert verdict.error is None, verdict.error
    result = verdict.l3
    assert "--hicache-storage-backend sim cannot store" in result.refused_attach
    assert result.refusal_left_controller_clean
    tokens = result.pages * PAGE_SIZE
    assert result.stored_tokens == result.hit_tokens == tokens, result
    assert result.fetched_tokens == tokens, result
    assert result.payload_restored and result.scales_restored, result
    assert result.dequantized_max_diff == 0.0, result
    assert result.untouched_pages_kept, result
    # Counted by the pool (metrics): a load's layer groups of 4 MiB and more
    # went through device staging; file: the last page cut short is a miss.
    assert verdict.moved["copy_engines/load"][0] > 0, verdict.moved
    if l3 == "file":
        assert result.refetched_tokens == tokens - PAGE_SIZE, result
        assert result.missed == {"wrong_size": 1}, result


@on_cpu
def test_hf3fs_shared_metadata_server(
    make_pools, storage_hooks, hf3fs_metadata_server, tmp_path, monkeypatch
):
    """hf3fs as deployments run it: every backend on one file and SGLang's own
    metadata server (hf3fs keys carry no model name). A new backend instance
    (a restarted server) finds the pages the first stored and restores them
    byte for byte; a pool of another geometry storing the same tokens on the
    same file and server gets its own keys and slots: each pool loads its own
    pages, whole."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    local = local_backend(
        "hf3fs", str(tmp_path), hf3fs={"metadata_server_url": hf3fs_metadata_server}
    )
    model = f"model-{uuid.uuid4().hex[:8]}"

    def open_(pool):
        with local.environment():
            return StoragePageIO.open(
                "hf3fs", pool, model_name=model, extra_config=local.extra_config
            )

    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=6)
    first = open_(host)
    ours = Stored(first, pages=6, seed=21)
    first.close()
    restarted = open_(host)
    assert hit_query(restarted, ours.tokens) == ours.hashes
    assert restarted.fetch(ours.hashes, page_token_indices(ours.dst)) == 6
    ours.check(6)

    _, other = make_pools(heads=2, head_dim=128, layers=3, pages=6)
    theirs = Stored(open_(other), pages=6, seed=21)
    assert theirs.tokens == ours.tokens
    assert theirs.fetch() == 6
    theirs.check(6)
    fill_host(host, 23)
    ours.before = host_pages(host, torch.arange(host.page_num))
    assert restarted.fetch(ours.hashes, page_token_indices(ours.dst)) == 6
    ours.check(6)
