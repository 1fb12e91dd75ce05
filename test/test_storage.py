"""MXFP8 pages through SGLang's real L3 backends, byte for byte.

``file`` is SGLang's ``HiCacheFile`` on a temporary directory; ``mooncake`` is
SGLang's ``MooncakeStore`` against a real master and a separate storage node on
loopback (the ``mooncake`` fixture), so every byte crosses Mooncake's TCP
transport. Pages move through ``tools.l3.StoragePageIO``: the backend built by
SGLang's factory and the cache controller's own page functions. The plugin's
storage hooks are applied for each test as ``HookRegistry`` applies them.

Host pages hold random bytes; pages go to L3 from one permuted set of host
pages and come back into another, and every host page outside the fetch must
keep its bytes. Test ids name the backend and the planted fault.
"""

from __future__ import annotations

import ctypes
import logging
import os
import uuid

import pytest
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import storage
from sglang_mxfp8_hicache.host_pool import (
    MHATokenToKVPoolMXFP8Host,
    MXFP8HiCacheConfigError,
)
from sglang_mxfp8_hicache.tools.l3 import StoragePageIO, page_hashes
from sglang_mxfp8_hicache.tools.selfcheck import (
    PAGE_SIZE,
    build_device_pool,
    build_host_pool,
    fill_random,
    host_page_rows,
    page_token_indices,
)

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


@pytest.fixture(params=["file", "mooncake"])
def backend(request, tmp_path, monkeypatch, storage_hooks) -> tuple[str, dict]:
    """(backend name, extra config) of a live backend."""
    if request.param == "file":
        monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
        return "file", {"file_storage_path": str(tmp_path / "l3")}
    return "mooncake", request.getfixturevalue("mooncake").extra_config()


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

    yield open_
    for io in opened:
        io.close()


def host_pages(host, pages: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``pages``' payload and scale bytes, as [side, page, bytes] rows."""
    return [r[:, pages].clone() for r in host_page_rows(host)]


def fill_host(host, seed: int) -> None:
    fill_random(host_page_rows(host), torch.Generator().manual_seed(seed))


class Stored:
    """``pages`` random host pages backed up to L3 under random tokens, then every
    host byte overwritten: what ``fetch`` must bring back into other pages."""

    def __init__(self, io: StoragePageIO, *, pages: int, seed: int = 0):
        host = io.storage_host_pool
        gen = torch.Generator().manual_seed(seed)
        fill_host(host, seed)
        self.io, self.host = io, host
        self.src = torch.randperm(host.page_num, generator=gen)[:pages]
        self.dst = torch.randperm(host.page_num, generator=gen)[:pages]
        self.tokens = torch.randint(
            0, 1 << 20, (pages * PAGE_SIZE,), generator=gen
        ).tolist()
        self.hashes = page_hashes(self.tokens, PAGE_SIZE)
        self.saved = host_pages(host, self.src)
        assert io.backup(self.hashes, page_token_indices(self.src))
        fill_host(host, seed + 1)
        self.before = host_pages(host, torch.arange(host.page_num))

    def fetch(self) -> int:
        return self.io.fetch(self.hashes, page_token_indices(self.dst))

    def check(self, arrived: int) -> None:
        """Host pages ``dst[:arrived]`` hold what was saved; every other host page,
        those of the pages that did not arrive included, kept its bytes."""
        now = host_pages(self.host, torch.arange(self.host.page_num))
        kept = torch.ones(self.host.page_num, dtype=torch.bool)
        kept[self.dst[:arrived]] = False
        for name, n, was, saved in zip(
            ("payload", "scales"), now, self.before, self.saved, strict=True
        ):
            arrived_pages = n[:, self.dst[:arrived]]
            assert torch.equal(arrived_pages, saved[:, :arrived]), f"{name} differs"
            assert torch.equal(n[:, kept], was[:, kept]), f"{name} changed outside"


# -- the page format, without a backend ------------------------------------------


@on_cpu
def test_flat_page_is_the_zero_copy_parts_concatenated(make_pools):
    """get_data_page is, byte for byte, what get_page_buffer_meta points at:
    [K payload | K scales] then [V payload | V scales], each inside a buffer of
    get_hybrid_pool_buffer (those a zero-copy backend registers)."""
    _, host = make_pools(heads=8, head_dim=128, layers=3, pages=6)
    fill_host(host, 3)
    pages = torch.tensor([4, 0, 2])
    ptrs, sizes = host.get_page_buffer_meta(page_token_indices(pages))
    assert len(ptrs) == 2 * len(pages)
    buffers = [
        (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
        for b in host.get_hybrid_pool_buffer()
    ]
    for n, page in enumerate(pages.tolist()):
        parts = [
            ctypes.string_at(ptr, size)
            for pair, pair_sizes in zip(
                ptrs[2 * n : 2 * n + 2], sizes[2 * n : 2 * n + 2], strict=True
            )
            for ptr, size in zip(pair, pair_sizes, strict=True)
        ]
        assert b"".join(parts) == host.get_data_page(page * PAGE_SIZE).numpy().tobytes()
        for pair, pair_sizes in zip(
            ptrs[2 * n : 2 * n + 2], sizes[2 * n : 2 * n + 2], strict=True
        ):
            for ptr, size in zip(pair, pair_sizes, strict=True):
                assert any(lo <= ptr and ptr + size <= hi for lo, hi in buffers)
    payload, scales = host.storage_part_bytes
    assert (payload, scales) == (PAGE_SIZE * 3 * 8 * 128, 3 * 8 * 4 * PAGE_SIZE)
    assert host.get_page_buffer_element_size() == payload + scales
    assert host.get_dummy_flat_data_page().numel() == 2 * (payload + scales)


@on_cpu
def test_element_size_through_a_host_pool_group(make_pools):
    """SGLang's HostPoolGroup (what the assemblers build) asks its anchor for the
    element size; the base class would fail on the nested sizes with int()."""
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
    assert group.get_page_buffer_element_size() == sum(host.storage_part_bytes)
    with pytest.raises(NotImplementedError, match="cannot be split by heads"):
        group.get_page_buffer_element_size(2)


@on_cpu
def test_flat_page_round_trip_and_wrong_size(make_pools):
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=4)
    fill_host(host, 5)
    page = host.get_data_page(2 * PAGE_SIZE)
    before = host_pages(host, torch.arange(host.page_num))
    host.set_from_flat_data_page(0, page)
    after = host_pages(host, torch.arange(host.page_num))
    for was, now in zip(before, after, strict=True):
        assert torch.equal(now[:, 0], was[:, 2])
        assert torch.equal(now[:, 1:], was[:, 1:])
    with pytest.raises(ValueError, match="flat page of"):
        host.set_from_flat_data_page(0, page[:-1])
    with pytest.raises(ValueError, match="not a page start"):
        host.get_data_page(5)
    with pytest.raises(ValueError, match="L3 page index 5 is not a page start"):
        host.get_page_buffer_meta(torch.arange(5, 5 + 2 * PAGE_SIZE))


@on_cpu
def test_format_tag_names_format_version_and_geometry(make_pools):
    tags = {
        make_pools(heads=h, head_dim=d, layers=layers, pages=2)[1].storage_format_tag
        for h, d, layers in ((2, 128, 2), (1, 256, 2), (2, 128, 3), (4, 128, 2))
    }
    assert len(tags) == 4
    # 2 heads x 128: 8 scale bytes per token, chunks of 64 tokens (512 B).
    assert "mxfp8v1-l2h2d128p128r64" in tags


# -- round trips and faults through the real backends ----------------------------


@pytest.mark.parametrize("pages", [1, 5, 130], ids=lambda p: f"{p}pages")
def test_round_trip(device, make_pools, open_io, pages):
    """130 pages: two controller batches of at most 128."""
    _, host = make_pools(heads=8, head_dim=128, layers=3, pages=pages)
    stored = Stored(open_io(host), pages=pages, seed=pages)
    assert stored.io.hit_query(stored.tokens) == stored.hashes
    assert stored.fetch() == pages
    stored.check(pages)


@pytest.mark.parametrize("kv_cache_dtype", ["fp4_mx_block16", "nvfp4"])
def test_round_trip_fp4(device, make_pools, open_io, kv_cache_dtype):
    """FP4 pages: the same page format, payload at its real width, tagged by recipe."""
    _, host = make_pools(
        heads=8, head_dim=128, layers=3, pages=5, kv_cache_dtype=kv_cache_dtype
    )
    assert host.storage_format_tag.startswith(f"{kv_cache_dtype}v1-l3h8d128p128")
    assert host.storage_part_bytes == (3 * 128 * 8 * 64, 3 * 128 * 8 * 8)
    stored = Stored(open_io(host), pages=5, seed=7)
    assert stored.io.hit_query(stored.tokens) == stored.hashes
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
    have the same bytes per page, and only the key tag tells them apart."""
    _, their_host = make_pools(
        heads=2, head_dim=128, layers=2, pages=4, kv_cache_dtype=theirs
    )
    _, our_host = make_pools(
        heads=2, head_dim=128, layers=2, pages=4, kv_cache_dtype=ours
    )
    if ours != "mxfp8":
        assert their_host.storage_part_bytes == our_host.storage_part_bytes
    # One model name for both pools, and for this test only: the Mooncake
    # store outlives the test.
    model = f"shared-{uuid.uuid4().hex[:8]}"
    stored = Stored(open_io(their_host, model), pages=3)
    assert stored.io.hit_query(stored.tokens) == stored.hashes
    mine = open_io(our_host, model)
    assert mine.hit_query(stored.tokens) == []
    assert mine.fetch(stored.hashes, page_token_indices(torch.arange(3))) == 0


def test_mooncake_pointers_lie_in_registered_buffers(
    make_pools, storage_hooks, mooncake, monkeypatch
):
    """Mooncake's TCP transport moves unregistered memory without a word, and RDMA
    would fail: every part a page names must lie in a buffer the pool registered."""
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
    assert len(registered) == 4
    stored = Stored(io, pages=6)
    ptrs, sizes = host.get_page_buffer_meta(page_token_indices(stored.dst))
    for pair, pair_sizes in zip(ptrs, sizes, strict=True):
        for ptr, size in zip(pair, pair_sizes, strict=True):
            assert any(lo <= ptr and ptr + size <= hi for lo, hi in registered)
    assert stored.fetch() == 6
    stored.check(6)


def _file_path(io: StoragePageIO, key: str) -> str:
    backend = io.storage_backend
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")


def _mooncake_keys(io: StoragePageIO, key: str) -> tuple[str, str]:
    backend = io.storage_backend
    [tagged] = backend._tag_keys([key])
    return f"{tagged}_{backend.mha_suffix}_k", f"{tagged}_{backend.mha_suffix}_v"


def _plant(io: StoragePageIO, key: str, fault: str) -> None:
    """Replace what L3 holds for ``key``: ``truncated`` / ``longer`` by a byte /
    64 bytes (the K object on Mooncake), ``other_geometry`` a page of twice the
    heads (both objects), ``missing`` the page, ``missing_part`` its V object."""
    if io.backend_name == "file":
        path = _file_path(io, key)
        if fault == "missing":
            os.remove(path)
            return
        size = os.path.getsize(path)
        new_size = {
            "truncated": size - 1,
            "longer": size + 64,
            "other_geometry": 2 * size,
        }
        with open(path, "wb") as f:
            f.write(os.urandom(new_size[fault]))
        return
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


FAULTS = [
    ("file", "truncated"),
    ("file", "longer"),
    ("file", "other_geometry"),
    ("file", "missing"),
    ("mooncake", "truncated"),
    ("mooncake", "longer"),
    ("mooncake", "other_geometry"),
    ("mooncake", "missing_part"),
]


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
        _plant(stored.io, key, fault)
    hits = stored.io.hit_query(stored.tokens)
    expected_hits = 2 if fault in ("missing", "missing_part") else 6
    assert hits == stored.hashes[:expected_hits]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        arrived = stored.fetch()
    assert arrived == 2
    stored.check(2)
    ours = [r.getMessage() for r in caplog.records if r.name == storage.__name__]
    if (backend[0], fault) == ("file", "missing"):
        assert ours == []  # HiCacheFile.get logs it
    else:
        [line] = ours
        assert "2 of 6 pages in this batch are missing a part or have the wrong" in line


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
    assert stored.io.hit_query(stored.tokens) == stored.hashes
    mine = open_io(ours, "shared-model")
    assert mine.hit_query(stored.tokens) == []
    fill_host(ours, 9)
    before = host_pages(ours, torch.arange(ours.page_num))
    assert mine.fetch(stored.hashes, page_token_indices(torch.arange(3))) == 0
    for was, now in zip(
        before, host_pages(ours, torch.arange(ours.page_num)), strict=True
    ):
        assert torch.equal(was, now)


# -- which backends may see an MXFP8 pool ------------------------------------------

REFUSED = sorted(storage.REFUSED_STORAGE_BACKENDS)


@on_cpu
@pytest.mark.parametrize("name", REFUSED)
def test_factory_refuses_backend_by_name(make_pools, storage_hooks, name):
    """At startup and at runtime attach alike (both go through the factory),
    before the backend is built."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    with pytest.raises(
        MXFP8HiCacheConfigError,
        match=f"--hicache-storage-backend {name} cannot store mxfp8 pages",
    ):
        StoragePageIO.open(name, host)


@on_cpu
def test_factory_refuses_layer_first_pool(make_pools, storage_hooks, tmp_path):
    """Runtime attach to a layer_first pool: its payload pages are not L3 pages."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2, layout="layer_first")
    with pytest.raises(
        MXFP8HiCacheConfigError, match="needs --hicache-mem-layout page_first"
    ):
        StoragePageIO.open(
            "file", host, extra_config={"file_storage_path": str(tmp_path)}
        )


def test_factory_leaves_other_pools_alone(bf16_host, storage_hooks, tmp_path):
    io = StoragePageIO.open(
        "file", bf16_host, extra_config={"file_storage_path": str(tmp_path)}
    )
    assert io.storage_backend.mem_pool_host is bf16_host
    with pytest.raises(Exception) as raised:
        StoragePageIO.open("nixl", bf16_host)
    assert not isinstance(raised.value, MXFP8HiCacheConfigError)


@on_cpu
def test_mooncake_startup_allocator_round_trip(
    device, cpu_kernels, storage_hooks, mooncake
):
    """With --hicache-storage-backend mooncake at startup, SGLang builds the host
    pool with Mooncake's host allocator: the scale mirror comes from it too."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeHostTensorAllocator,
    )

    device_pool = build_device_pool(
        head_num=4, head_dim=128, layer_num=2, pages=9, device="cpu"
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
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

    from sglang_mxfp8_hicache.tools.mooncake_loopback import MooncakeLoopback

    _, host = make_pools(heads=4, head_dim=128, layers=2, pages=4)
    with MooncakeLoopback() as service:
        io = StoragePageIO.open(
            "mooncake",
            host,
            model_name="backend-error",
            extra_config=service.extra_config(),
        )
        stored = Stored(io, pages=4, seed=31)
        assert io.hit_query(stored.tokens) == stored.hashes
        node = service.pids["node"]
        os.kill(node, signal.SIGKILL)
        os.waitpid(node, 0)
        assert stored.fetch() == 0
        stored.check(0)
