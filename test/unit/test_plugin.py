"""Dispatch through SGLang's real plugin loading, in fresh processes.

``testkit/probe.py`` builds real device pools and asks both names of
``get_mha_host_pool_cls`` after ``sglang.srt.plugins.load_plugins()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from sglang_mxfp8_hicache import hooks, plugin, releases
from testkit import ROOT, script

DISABLE_ENV = "SGLANG_MXFP8_HICACHE_DISABLE"

OURS = "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
SGLANG_MXFP8 = "sglang.srt.mem_cache.pool_host.mha_mxfp8.MHATokenToKVPoolMXFP8Host"
SGLANG_PLAIN = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"


def run_dispatch(order: str, **env: str) -> tuple[dict[str, str], str]:
    environ = {**os.environ, **env}
    environ.pop("SGLANG_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, script("probe")]
        + (["--assembler-first"] if order == "assembler_first" else []),
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_entry_point_is_installed():
    eps = entry_points(group="sglang.srt.plugins")
    assert "sglang_mxfp8_hicache.plugin:register" in {ep.value for ep in eps}


@pytest.mark.parametrize("order", ["plugins_first", "assembler_first"])
def test_plugin_dispatch_in_fresh_process(order):
    chosen, log = run_dispatch(order)
    for where in ("mha", "assembler"):
        assert chosen[f"mxfp8/{where}"] == OURS
        # Per-token scales: ours too, so the refusal names --page-size 128.
        assert chosen[f"mxfp8_page64/{where}"] == OURS
        assert chosen[f"bf16/{where}"] == SGLANG_PLAIN
        assert chosen[f"fp8/{where}"] == SGLANG_PLAIN
        assert chosen[f"fp4_mx_block16/{where}"] == OURS
        assert chosen[f"nvfp4/{where}"] == OURS
    assert chosen["storage/factory"] == "hooked"
    # One line per chosen class and format per process, not one per call.
    assert log.count(f"HiCache host pool: {OURS}") == 3
    for kv_cache_dtype in ("mxfp8", "fp4_mx_block16", "nvfp4"):
        assert f"({kv_cache_dtype} device pool, pages with their scales" in log
    assert log.count(f"HiCache host pool: {SGLANG_PLAIN}") == 1


def test_plugin_disabled_by_environment():
    chosen, log = run_dispatch("plugins_first", **{DISABLE_ENV: "1"})
    assert chosen["mxfp8/mha"] == SGLANG_MXFP8
    assert chosen["mxfp8/assembler"] == SGLANG_MXFP8
    assert chosen["bf16/mha"] == SGLANG_PLAIN
    assert chosen["storage/factory"] == "sglang"
    assert f"disabled by {DISABLE_ENV}" in log


@pytest.fixture
def recorded_hooks(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    calls = []
    monkeypatch.setattr(HookRegistry, "register", lambda *a, **kw: calls.append(a))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_refusing", False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return calls


def test_register_is_idempotent(recorded_hooks):
    plugin.register()
    plugin.register()
    targets = [call[0] for call in recorded_hooks]
    assert targets == [hook.target for hook in hooks.served_hooks()]
    # Where the release has _mha_host_inputs (0.5.23); else the selector refuses.
    inputs = any(t.endswith("._mha_host_inputs") for t in targets)
    assert inputs != releases.builds_from_device_pool()
    assert len(targets) == 8 - (not inputs)
    assert plugin.is_registered()


def test_every_hook_target_resolves():
    """Each target names a function or method of the installed SGLang: one
    that did not resolve would only be logged by SGLang's registry."""
    import importlib

    for hook in hooks.served_hooks():
        parts = hook.target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for name in parts[cut:]:
            found = getattr(found, name)
        assert callable(found) and callable(hook.function()), hook.target
        assert hook.hook_type in ("AROUND", "AFTER") and hook.if_missing


@pytest.mark.parametrize(
    "version, level, target, says",
    [
        ("0.5.20", "ERROR", "resolve_once", "back with wrong scales, silently"),
        ("0.5.16", "ERROR", "__post_init__", "back with wrong scales, silently"),
        ("0.5.24", "WARNING", "resolve_once", "not a release it is tested with"),
        ("0.6.0", "WARNING", "resolve_once", "not a release it is tested with"),
    ],
)
def test_register_refuses_on_unserved_sglang(
    recorded_hooks, monkeypatch, caplog, version, level, target, says
):
    """Outside the served releases: no host pool hook, one log line naming the
    release and the fixes, and one hook that refuses block-scaled KV with
    HiCache where that release resolves its server arguments."""
    monkeypatch.setattr(releases, "sglang_version", lambda: version)
    plugin.register()
    plugin.register()
    [(hooked, hook, _)] = recorded_hooks
    assert hooked == f"sglang.srt.server_args.ServerArgs.{target}"
    assert hook is plugin.refuse_on_unserved_release
    assert not plugin.is_registered()
    [record] = caplog.records
    assert record.levelname == level
    message = record.getMessage()
    assert f"sglang {version}" in message and says in message
    assert "Install sglang==0.5.23" in message


@pytest.mark.parametrize(
    "dtype, hicache, refused",
    [
        ("mxfp8", True, True),
        ("nvfp4", True, True),
        ("fp4_mx_block16", True, True),
        ("mxfp8", False, False),
        ("fp8_e4m3", True, False),
        ("auto", True, False),
    ],
)
def test_unserved_release_refuses_block_scaled_hicache_only(
    monkeypatch, dtype, hicache, refused
):
    """The refusal on an unserved release stops block-scaled KV with HiCache,
    naming the format, and leaves every other setup to SGLang."""
    from types import SimpleNamespace

    from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

    monkeypatch.setattr(releases, "sglang_version", lambda: "0.5.20")
    args = SimpleNamespace(
        kv_cache_dtype=dtype, enable_hierarchical_cache=hicache, model_path="dummy"
    )
    if not refused:
        assert plugin.refuse_on_unserved_release("result", args) == "result"
        return
    with pytest.raises(BlockScaledHiCacheConfigError) as error:
        plugin.refuse_on_unserved_release("result", args)
    assert str(error.value).startswith(f"{dtype} HiCache: sglang-mxfp8-hicache")
    assert "sglang 0.5.20 has an MXFP8 KV pool" in str(error.value)


def _selector_input(**pool):
    """What the release's assembler hands the host pool hooks for a small CPU
    device pool (``tools.pools.build_device_pool``)."""
    from sglang_mxfp8_hicache.tools.pools import build_device_pool

    device_pool = build_device_pool(
        head_num=2, head_dim=128, layer_num=1, pages=1, device="cpu", **pool
    )
    return releases.host_pool_selector_input(device_pool)


def test_hook_passes_other_pools_to_original():
    sentinel = type("Sentinel", (), {})
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
        given = _selector_input(payload_dtype=dtype)
        info = releases.buffer_info(given)
        assert info.scales is None
        assert plugin.claims(info) is None
        assert plugin.select_host_pool_cls(lambda given: sentinel, given) is sentinel


@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", "fp4_mx_block16", "nvfp4"])
def test_hook_claims_block_scaled_pools(kv_cache_dtype):
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

    given = _selector_input(kv_cache_dtype=kv_cache_dtype)
    reason = plugin.claims(releases.buffer_info(given))
    assert reason.startswith(f"{kv_cache_dtype} device pool")
    chosen = plugin.select_host_pool_cls(lambda given: None, given)
    assert issubclass(chosen, MHATokenToKVPoolMXFP8Host)


@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", "fp4_mx_block16", "nvfp4"])
def test_no_payload_staging_for_block_scaled_pools(kv_cache_dtype):
    """SGLang's write-back staging (GPU memory sized for its page_first payload
    kernel) is not prepared for a pool of ours before the KV cache is sized;
    other pools get SGLang's."""
    calls = []

    def original(info, **kwargs):
        calls.append(kwargs)
        return "staging"

    ours = _selector_input(kv_cache_dtype=kv_cache_dtype)
    other = _selector_input(payload_dtype=torch.bfloat16)
    kwargs = dict(layer_num=1, page_size=128)

    def prepare():
        """What SGLang's prepare_hicache_staging does for two pools."""
        return [
            plugin.skip_payload_staging(original, info, **kwargs)
            for info in (ours, other)
        ]

    assert plugin.mark_staging_preparation(prepare) == [None, "staging"]
    assert calls == [kwargs]
    # Outside that preparation (a host pool of SGLang's own, built later, asks
    # for its staging) nothing is skipped.
    assert plugin.skip_payload_staging(original, ours, **kwargs) == "staging"


@pytest.mark.parametrize("order", ["plugins_first", "builder_first"])
def test_staging_hook_reaches_the_builder_alias(order):
    """The registry rebinds kv_cache_builder's alias of the staging function
    (what prepare_hicache_staging calls), whichever is imported first."""
    load = "from sglang.srt.plugins import load_plugins; load_plugins()\n"
    builder = "from sglang.srt.mem_cache import kv_cache_builder as b\n"
    code = (load + builder if order == "plugins_first" else builder + load) + (
        "print(hasattr(b.prepare_mha_write_back_staging, '__wrapped__'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_core_imports_no_tools_and_no_cycle():
    """The core a server imports (the package's top-level modules) takes
    nothing from ``tools``, and no two of its modules import each other,
    even lazily (imports inside functions count)."""
    import ast
    import pathlib

    import sglang_mxfp8_hicache

    package = pathlib.Path(sglang_mxfp8_hicache.__file__).parent
    core = {p.stem: p for p in package.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {}
    for name, path in core.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
                if node.module == "sglang_mxfp8_hicache":
                    modules += [f"sglang_mxfp8_hicache.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "sglang_mxfp8_hicache" and len(parts) > 1:
                    assert parts[1] != "tools", f"{name} imports {module}"
                    if parts[1] in core:
                        imported.add(parts[1])
        edges[name] = imported - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges[start] - seen:
            if nxt == goal or reaches(nxt, goal, seen | {nxt}):
                return True
        return False

    cycles = [name for name in core if reaches(name, name, set())]
    assert cycles == [], f"import cycle through {cycles}"


FLAG_CASES = {
    "page_size": (["--page-size", "64"], "set --page-size 128"),
    "layout": (
        ["--hicache-mem-layout", "page_first_kv_split"],
        "--hicache-mem-layout page_first_kv_split is not served",
    ),
    "io_backend": (["--hicache-io-backend", "kernel_ascend"], "kernel_ascend is not"),
    "storage": (["--hicache-storage-backend", "aibrix"], "aibrix cannot store"),
    "sealed_page_head": (
        ["--hicache-storage-backend", "hf3fs", "--hicache-mem-layout", "page_head"],
        "a heads-major page has none",
    ),
    "decode_host_receive": (
        ["--disaggregation-decode-host-receive-threshold", "0.5"],
        "leave the threshold at 1",
    ),
    "served": (["--hicache-storage-backend", "file"], None),
    "nixl_o_direct_served": (
        [
            "--hicache-storage-backend",
            "nixl",
            "--hicache-storage-backend-extra-config",
            '{"use_direct_io": true}',
        ],
        None,
    ),
    "fp4_any_page_size": (["--kv-cache-dtype", "fp4_mx_block16"], None),
}
_RESOLVE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
base = ["--model-path", "dummy", "--kv-cache-dtype", "mxfp8", "--page-size", "128",
        "--enable-hierarchical-cache"]
for case in json.loads(sys.argv[1]):
    try:
        prepare_server_args(base + case).resolve_once()
        print(json.dumps(None))
    except Exception as exc:
        print(json.dumps(f"{type(exc).__name__}: {exc}"))
"""


def test_flags_refused_when_sglang_resolves_them():
    """Each row of the refusal table stops a launch when SGLang resolves its
    server arguments (the plugin's hook on ``ServerArgs.resolve_once``, in a
    fresh process as a launcher runs it), with the pool's reason; served
    flags, and FP4 at a page size other than 128, pass."""
    argv = json.dumps([flags for flags, _ in FLAG_CASES.values()])
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE, argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    for (name, (_, says)), result in zip(FLAG_CASES.items(), results, strict=True):
        if says is None:
            assert result is None, (name, result)
        else:
            assert result.startswith("BlockScaledHiCacheConfigError: mxfp8 HiCache"), (
                name
            )
            assert says in result, (name, result)


BAD_SETTINGS = [
    ("SGLANG_MXFP8_HICACHE_STAGING_MB", "-1"),
    ("SGLANG_MXFP8_HICACHE_STAGING_MB", "100000000000"),
    ("SGLANG_MXFP8_HICACHE_SEAL_THREADS", "0"),
    ("SGLANG_MXFP8_HICACHE_SEAL_THREADS", "abc"),
    ("SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES", "\u00b2"),
    ("SGLANG_MXFP8_HICACHE_DISABLE", "banana"),
]
MISSPELT_SETTING = ("SGLANG_MXFP8_HICACHE_STAGING", "128")
"""A name the package does not read: refused, naming the variable meant."""
_RESOLVE_WITH_SETTING = """
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_mxfp8_hicache import settings
base = ["--model-path", "dummy", "--kv-cache-dtype", "mxfp8", "--page-size", "128",
        "--enable-hierarchical-cache"]
for name, value in json.loads(sys.argv[1]):
    os.environ[name] = value
    settings.current.cache_clear()
    try:
        prepare_server_args(base).resolve_once()
        print(json.dumps(None))
    except Exception as exc:
        print(json.dumps(f"{type(exc).__name__}: {exc}"))
    del os.environ[name]
"""


def test_bad_settings_refused_when_sglang_resolves_the_flags():
    """A variable's bad value stops a block-scaled launch with HiCache when
    SGLang resolves its arguments, before a model loads: one line naming the
    variable, the value and what it accepts; a misspelt name stops it too,
    naming the closest variable. A good value passes."""
    good = ("SGLANG_MXFP8_HICACHE_SEAL_THREADS", "8")
    cases = [*BAD_SETTINGS, MISSPELT_SETTING, good]
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE_WITH_SETTING, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    *refused, misspelt, served = [json.loads(line) for line in done.stdout.splitlines()]
    for (name, value), result in zip(BAD_SETTINGS, refused, strict=True):
        said = f"BlockScaledHiCacheConfigError: {name}={value!r} is not accepted: give"
        assert result.startswith(said) and "\n" not in result, result
    assert misspelt == (
        "BlockScaledHiCacheConfigError: SGLANG_MXFP8_HICACHE_STAGING is not a "
        "variable sglang-mxfp8-hicache reads: did you mean "
        "SGLANG_MXFP8_HICACHE_STAGING_MB? Rename or unset it."
    )
    assert served is None


def test_launch_server_refuses_flags_before_the_model():
    """``python -m sglang.launch_server`` with a refused flag exits with the
    reason as soon as its arguments are resolved, before a model is loaded
    (``dummy``: SGLang's path for no model)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            "dummy",
            "--kv-cache-dtype",
            "mxfp8",
            "--page-size",
            "64",
            "--enable-hierarchical-cache",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    [line] = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("sglang_mxfp8_hicache.errors.BlockScaledHiCacheConfigError")
    ]
    assert "set --page-size 128" in line


@pytest.mark.parametrize("mla", [False, True])
def test_flag_refusals_leave_mla_models_alone(monkeypatch, mla):
    """An MLA model keeps SGLang's own host pool, so the table (about ours)
    does not stop it; an MHA model with the same flags is stopped."""
    from types import SimpleNamespace

    monkeypatch.setattr(
        "sglang.srt.arg_groups.model_override_base.use_mla_backend", lambda args: mla
    )
    view = SimpleNamespace(
        enable_hierarchical_cache=True,
        kv_cache_dtype="mxfp8",
        model_path="/models/any",
        page_size=64,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config={"a": 1},
        disaggregation_decode_host_receive_threshold=None,
    )
    monkeypatch.setattr(
        "sglang.srt.arg_groups.overrides.resolving_view", lambda args: view
    )
    if mla:
        assert plugin.refuse_unserved_flags("result", object()) == "result"
    else:
        with pytest.raises(ValueError, match="set --page-size 128"):
            plugin.refuse_unserved_flags("result", object())


_BUILD_WITHOUT = """
import importlib, json, logging, sys
import pytest
target, tests = sys.argv[1:]
sys.path.insert(0, tests)
from testkit.kernel_emulation import install_emulation
install_emulation(pytest.MonkeyPatch())  # the CPU's kernels, as in the tests
module, attr = target.rsplit(".", 1)
owner = module.rsplit(".", 1)
try:
    holder = importlib.import_module(module)
except ImportError:  # a method: its class in its module
    holder = getattr(importlib.import_module(owner[0]), owner[1])
delattr(holder, attr)  # the registry cannot resolve it: logged, not applied
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_mxfp8_hicache import hooks
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host as Ours
from sglang_mxfp8_hicache.tools.pools import build_device_pool, build_host_pool
print(json.dumps([[s.target, s.in_force] for s in hooks.hook_states()]))
device_pool = build_device_pool(head_num=2, head_dim=128, layer_num=1, pages=2,
                                device="cpu")
try:
    build_host_pool(device_pool, Ours, host_to_device_ratio=2.0, pin_memory=False)
    print(json.dumps(None))
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__}: {exc}"))
"""


@pytest.mark.parametrize(
    "missing, refused",
    [
        ("sglang.srt.mem_cache.kv_cache_builder.prepare_hicache_staging", False),
        (
            "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory."
            "create_backend",
            True,
        ),
    ],
)
def test_a_missing_hook_is_named_and_one_that_makes_pages_wrong_refuses(
    missing, refused
):
    """A target SGLang's registry cannot resolve (an SGLang installed without
    a module) leaves that hook out; the pool's log line names it and its cost,
    or, where pages could restore wrong without it, the pool is refused."""
    assert missing in {hook.target for hook in hooks.served_hooks()}
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_WITHOUT, missing, str(ROOT / "test")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    states, result = [json.loads(line) for line in done.stdout.splitlines()[-2:]]
    assert [t for t, in_force in states if not in_force] == [missing]
    if refused:
        assert result.startswith("BlockScaledHiCacheConfigError"), result
        assert missing in result and "restore wrong" in result
    else:
        assert result is None, result
        cost = "prepare_hicache_staging: staging taken after SGLang sized the KV pool"
        assert f"plugin hooks missing: {cost}" in done.stderr
