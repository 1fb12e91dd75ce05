"""What the L3 guards rely on in SGLang, checked on the installed release (CI
runs ``test/unit`` on every served release): the private names they read and
the backends' own methods they sit between."""

from __future__ import annotations

from sglang_mxfp8_hicache import releases, storage


def _sglang_classes() -> dict[str, type]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeStore,
    )
    from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
    from sglang.srt.plugins.hook_registry import HookRegistry

    classes = [HiCacheFile, HiCacheNixl, MooncakeStore, HookRegistry]
    injector = releases.failure_injector_type()  # 0.5.23 on
    return {c.__name__: c for c in (*classes, *([injector] if injector else []))}


def test_every_private_sglang_name_the_guards_read_exists():
    """A release that renames one of them fails here, naming it."""
    classes = _sglang_classes()
    for dotted in storage.SGLANG_PRIVATE_NAMES:
        owner, name = dotted.split(".")
        if owner not in classes:
            assert owner == "HiCacheStorageFailureInjector", dotted
            continue
        cls = classes[owner]
        found = hasattr(cls, name) or name in getattr(cls, "__annotations__", {})
        assert found, f"SGLang's {owner} has no {name} any more: {dotted} moved"


def test_inner_calls_are_the_backends_and_the_guards():
    """Each inner call a backend's row names is a method of SGLang's backend
    class, and its guard has the method that sits in it."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    for name, served in storage.BACKENDS.items():
        for method in served.inner_calls or ():
            assert hasattr(served.guard, f"inner_{method}"), (name, method)
            if name != "dynamic":  # a class of the operator's
                cls = StorageBackendFactory._registry[name]["loader"]()
                assert callable(getattr(cls, method, None)), (name, method)


def test_policy_is_consistent():
    """A sealed or key-prefixed backend has a guard that seals; a refused one
    is not served; on the newest release, every served backend is one SGLang's
    factory knows (an older release may lack one: its factory refuses it)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_mxfp8_hicache.guards import SealedGuard

    for name, served in storage.BACKENDS.items():
        if served.sealed or served.key_prefixed:
            assert served.guard is not None and issubclass(served.guard, SealedGuard)
        if releases.sglang_version() == releases.NEWEST and name != "dynamic":
            assert name in StorageBackendFactory._registry, name
    assert not set(storage.BACKENDS) & set(storage.REFUSED_STORAGE_BACKENDS)
