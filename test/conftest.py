from __future__ import annotations

import functools
import sys

import pytest
import torch

from testkit.kernel_emulation import EmulatedKernels

HAS_CUDA = torch.cuda.is_available()
SESSION_MOONCAKE_SEGMENT = "2GB"


def pytest_addoption(parser):
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=20.0,
        help="how long each soak run drives the cache (soak/test_soak.py)",
    )
    parser.addoption(
        "--soak-seed",
        type=int,
        default=0,
        help="the soak's workload and shadow seed (a sweep: one session per seed)",
    )


def pytest_terminal_summary(terminalreporter):
    """The soak runs' figures (``soak/test_soak.py`` puts them in its reports'
    ``user_properties``, which xdist's workers send back too)."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "soak figures"
    ]
    if lines:
        terminalreporter.section("soak figures")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (SGLang's JIT kernels)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_settings():
    """Each test reads the package's environment variables afresh: a server
    reads them once per process (``settings.current``), a test may set them."""
    from sglang_mxfp8_hicache import settings

    settings.current.cache_clear()
    yield
    settings.current.cache_clear()


@pytest.fixture
def cpu_kernels(monkeypatch) -> EmulatedKernels:
    """SGLang's JIT HiCache kernels and ours replaced by CPU emulations of
    their contracts (``kernel_emulation.install_emulation``)."""
    from testkit.kernel_emulation import install_emulation

    return install_emulation(monkeypatch)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Where the pools live: the CPU with the kernel emulations, or a GPU with
    SGLang's real JIT kernels and ours."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_kernels")
    return request.param


@pytest.fixture
def make_pools(device, request):
    """Builds a block-scaled device pool of ``2 * pages + 1`` pages and a host pool of
    three quarters of it on ``device``; destroys the host pools afterwards."""
    kernels = request.getfixturevalue("cpu_kernels") if device == "cpu" else None
    hosts = []

    def make(*, drafts=None, **geometry):
        """(device pool, host pool) of ``_build_pools``' ``geometry``; with
        ``drafts=n``, also the n one-layer draft device pools packed into the
        host pool (MTP/NextN)."""
        device_pool, host, draft_pools = _build_pools(
            device, kernels, drafts=drafts or 0, **geometry
        )
        hosts.append(host)
        if drafts is None:
            return device_pool, host
        return device_pool, host, draft_pools

    yield make
    for host in hosts:
        host.destroy()


def _build_pools(
    device,
    kernels,
    *,
    heads,
    head_dim,
    layers,
    pages,
    host_cls=None,
    drafts=0,
    layout="page_first",
    kv_cache_dtype="mxfp8",
    page_size=128,
    v_head_dim=None,
):
    """A device pool of ``kv_cache_dtype`` and ``drafts`` one-layer draft
    pools, and the host pool (``host_cls``, ours by default) packing them;
    on the CPU their buffers registered with ``kernels``' pointer map (the
    kernels read host pointer tables too)."""
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
    from sglang_mxfp8_hicache.tools.pools import build_device_pool, build_host_pool
    from testkit.pools import device_buffers

    device_pools = [
        build_device_pool(
            head_num=heads,
            head_dim=head_dim,
            layer_num=n,
            pages=2 * pages + 1,
            device=device,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            v_head_dim=v_head_dim,
        )
        for n in (layers, *[1] * drafts)
    ]
    device_pool, *draft_pools = device_pools
    if kernels:
        for pool in device_pools:
            kernels.pointers.register(device_buffers(pool))
    host = build_host_pool(
        device_pool,
        host_cls or MHATokenToKVPoolMXFP8Host,
        host_to_device_ratio=0.75,
        pin_memory=device == "cuda",
        drafts=draft_pools,
        layout=layout,
    )
    if kernels:
        kernels.pointers.register([host.kv_buffer])
    return device_pool, host, draft_pools


@pytest.fixture(scope="module")
def hf3fs_metadata_server():
    """SGLang's own 3FS metadata server (``mini_3fs_metadata_server``) on a
    free loopback port, for the module; yields its URL."""
    import subprocess
    import time
    import urllib.request

    from testkit.mooncake_loopback import die_with_parent, free_ports

    [port] = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/docs", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("the 3FS metadata server did not start")
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture(scope="session")
def seaweedfs():
    """A SeaweedFS server with its S3 gateway on 127.0.0.1 for the session
    (``testkit/seaweedfs_loopback.py``)."""
    from testkit.seaweedfs_loopback import (
        SeaweedFSLoopback,
        seaweedfs_available,
    )

    yield from _loopback_service("SeaweedFS", seaweedfs_available, SeaweedFSLoopback)


@pytest.fixture(scope="session")
def mooncake():
    """A real Mooncake master and storage node on 127.0.0.1 for the session
    (``testkit/mooncake_loopback.py``); skips where Mooncake cannot run.

    Pass ``mooncake.extra_config()`` as the storage config's ``extra_config``:
    the test's client then holds no segment and every byte crosses TCP.
    The storage node holds 2 GB (touched only as it fills): the session's
    tests store more than 512 MB and remove nothing, and a put into a store
    at its watermark can fail before Mooncake's eviction catches up.
    """
    from testkit.mooncake_loopback import (
        MooncakeLoopback,
        mooncake_available,
    )

    service = functools.partial(MooncakeLoopback, segment_size=SESSION_MOONCAKE_SEGMENT)
    yield from _loopback_service("Mooncake", mooncake_available, service)


def _loopback_service(name, available, service_class):
    """The service of a session fixture, started for the session; the test
    skips, saying why, where it cannot run here."""
    reason = available()
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")
    with service_class() as service:
        yield service
