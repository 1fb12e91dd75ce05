"""SGLang plugin: route block-scaled (MXFP8, FP4) device pools to our HiCache host pool.

SGLang calls ``load_plugins()`` at the start of every process it spawns;
that loads the ``sglang.srt.plugins`` entry point ``mxfp8_hicache`` ->
:func:`register`, which installs ``hooks.served_hooks()`` (each says what it does).
Hooks are AROUND but one: the registry rebinds every module-level alias of a
target, so a hook calls the original it is handed, never an alias.

On a release this package does not serve (``releases.SUPPORTED_SGLANG_VERSIONS``)
one hook refuses a block-scaled KV cache with HiCache at launch
(``refuse_on_unserved_release``); every other setup is left to SGLang.
``SGLANG_MXFP8_HICACHE_DISABLE=1`` registers nothing.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_mxfp8_hicache import hooks, releases, settings
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError, refusal_error
from sglang_mxfp8_hicache.geometry import buffer_scale_format, is_packed_fp4

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

logger = logging.getLogger(__name__)

_registered = False
_refusing = False  # the refusal of an unserved release is registered
_logged_choices: set[tuple[str, str, str]] = set()


def is_registered() -> bool:
    return _registered


def claims(buffer_info: MHABufferInfo) -> str | None:
    """Why our class takes this device pool, or None to leave it to SGLang:
    every block-scaled pool, and an FP4 pool without per-token scales, so
    that one we cannot serve gets our error naming the flag."""
    fmt = buffer_scale_format(buffer_info)
    if fmt is not None:
        return (
            f"{fmt.name} device pool, pages with their scales by sglang-mxfp8-hicache"
        )
    if is_packed_fp4(buffer_info):
        return (
            "FP4 device pool without per-token scales, refused by sglang-mxfp8-hicache"
        )
    return None


def select_host_pool_cls(
    original: Callable[[MHABufferInfo], type], buffer_info: MHABufferInfo
) -> type:
    """AROUND hook on ``get_mha_host_pool_cls``, which a release that builds
    host pools from the device pool (``releases``) hands the device pool: ours
    is then made from it, and its native nvfp4 scales are refused here."""
    pool_or_info = buffer_info
    reason = claims(releases.buffer_info(pool_or_info))
    if reason is not None:
        from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

        chosen = MHATokenToKVPoolMXFP8Host
        if releases.builds_from_device_pool():
            _refuse_native_scales((pool_or_info,))
            chosen = releases.built_from_device_pool(chosen)
    else:
        chosen = original(pool_or_info)
        reason = "not a block-scaled device pool, SGLang's own choice"
    key = (chosen.__module__, chosen.__qualname__, reason)
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.info("HiCache host pool: %s.%s (%s).", *key)
    return chosen


def refuse_native_fp4_scales(original: Callable[..., Any], pool, drafts=()):
    """AROUND hook on the assembler's ``_mha_host_inputs``: nvfp4 for
    trtllm_mha (SM100) keeps a native copy of its scales that no host pool is
    given, so a host tier would restore them stale; refused wherever a stack
    is built, before any host pool is."""
    _refuse_native_scales((pool, *drafts))
    return original(pool, drafts)


def _refuse_native_scales(device_pools) -> None:
    for device_pool in device_pools:
        if getattr(device_pool, "native_k_scale_buffer", None) is not None:
            raise refusal_error(
                "the device pool keeps native trtllm_mha scales "
                "(SM100) outside the buffers a host pool is given; no host pool "
                "could restore them, and SGLang has no function that rebuilds "
                "them from the per-token copy. Use --attention-backend "
                "flashinfer for both phases, or run without "
                "--enable-hierarchical-cache.",
                "nvfp4",
            )


_preparing_staging: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sglang_mxfp8_hicache_preparing_staging", default=False
)


def mark_staging_preparation(original: Callable[..., Any], **kwargs):
    """AROUND hook on ``prepare_hicache_staging``, where SGLang allocates GPU
    staging for every MHA pool's write-back before it measures the KV budget:
    ``skip_payload_staging`` acts only inside it."""
    token = _preparing_staging.set(True)
    try:
        return original(**kwargs)
    finally:
        _preparing_staging.reset(token)


def skip_payload_staging(original: Callable[..., Any], buffer_info, **kwargs):
    """AROUND hook on ``prepare_mha_write_back_staging``: no staging for a pool
    of ours while SGLang prepares it before sizing the KV cache (it serves
    SGLang's own write-back kernel); ours is reserved in its place. A host
    pool of SGLang's own built later still gets its staging."""
    info = releases.buffer_info(buffer_info)  # the device pool before 0.5.23
    if _preparing_staging.get() and claims(info) is not None:
        _reserve_device_staging(info.device)
        return None
    return original(buffer_info, **kwargs)


def _reserve_device_staging(device) -> None:
    """Our pools' own device staging, made where SGLang's would have been:
    before the KV budget is measured. If it cannot be made now (no kernel
    builds here), the pool makes it, or goes without, when it is built."""
    import torch

    from sglang_mxfp8_hicache import transfer

    staging = settings.current().staging_bytes
    try:
        reserved = transfer.reserve_staging(torch.device(device), staging) >> 20
    except Exception as exc:  # the pool reports what it then chooses
        logger.debug("block-scaled HiCache staging not made before sizing: %s", exc)
        return
    if reserved:
        logger.info("Block-scaled HiCache staging before KV sizing: %d MiB.", reserved)


def keeps_cpu_host_indices(io_backend: str, host_pool: Any, host_indices) -> bool:
    """Whether a controller hands ``host_pool`` its CPU host indices as they
    are: with the ``kernel`` io backend, for a pool of ours, which reads them
    on the CPU (GPU ones keep a transfer off the copy engines)."""
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

    return (
        io_backend == "kernel"
        and not host_indices.is_cuda
        and isinstance(host_pool, MHATokenToKVPoolMXFP8Host)
    )


def keep_host_indices_on_cpu(
    original: Callable[..., Any], controller, host_indices, device_indices
):
    """AROUND hook on ``HiCacheController.move_indices``: a pool of ours keeps
    its CPU host indices (``keeps_cpu_host_indices``); everything else is
    SGLang's own move."""
    if keeps_cpu_host_indices(
        controller.io_backend, controller.mem_pool_host, host_indices
    ):
        return host_indices, device_indices
    return original(controller, host_indices, device_indices)


def keep_pool_host_indices_on_cpu(
    original, controller, host_pool, host_indices, device_indices, **kwargs
):
    """AROUND hook on ``HybridCacheController._move_pool_indices`` (each pool
    of a hybrid stack): as ``keep_host_indices_on_cpu``."""
    if keeps_cpu_host_indices(controller.io_backend, host_pool, host_indices):
        return host_indices, device_indices
    return original(controller, host_pool, host_indices, device_indices, **kwargs)


def unserved_release_reason(found: str | None) -> str:
    """Why block-scaled KV with HiCache is refused on SGLang ``found``, and
    what to do instead."""
    why, instead = (
        f"sglang {found} is not a release it is tested with",
        (
            ", or set SGLANG_MXFP8_HICACHE_DISABLE=1 to leave the host pool to SGLang "
            "(its own keeps MXFP8 scales in host memory only, and FP4 scales nowhere)"
        ),
    )
    if _loses_scales(found):
        why, instead = (
            (
                f"sglang {found} has an MXFP8 KV pool but no block-scaled HiCache "
                "host pool: its host pool backs up the payload without the scales, "
                "and pages come back with wrong scales, silently"
            ),
            "",
        )
    return (
        "sglang-mxfp8-hicache serves block-scaled KV in HiCache on sglang "
        f"{' / '.join(releases.SUPPORTED_SGLANG_VERSIONS)}; {why}. Install "
        f"sglang=={releases.NEWEST}, or run without --enable-hierarchical-cache"
        f"{instead}."
    )


def refuse_on_unserved_release(result: Any, server_args: Any, *args, **kwargs) -> Any:
    """AFTER hook on ``ServerArgs.resolve_once`` (``__post_init__`` before
    0.5.19), instead of every other hook on a release this package does not
    serve: a block-scaled KV cache with HiCache stops the launch."""
    try:  # the arguments as SGLang resolves them (0.5.20 on)
        from sglang.srt.arg_groups.model_override_base import resolving_view

        view = resolving_view(server_args)
    except Exception:  # the plain attributes: what the older releases resolve
        view = server_args
    dtype = _block_scaled_hicache(server_args, view)
    if dtype is not None:
        raise refusal_error(unserved_release_reason(releases.sglang_version()), dtype)
    return result


def _block_scaled_hicache(server_args: Any, view: Any) -> str | None:
    """The block-scaled ``--kv-cache-dtype`` of a launch with HiCache whose
    model gets an MHA pool (an MLA pool keeps SGLang's own host pool), or None."""
    from sglang_mxfp8_hicache.geometry import FORMATS

    dtype = getattr(view, "kv_cache_dtype", None)
    if not getattr(view, "enable_hierarchical_cache", False) or dtype not in FORMATS:
        return None
    model_path = str(getattr(view, "model_path", "")).lower()
    try:
        from sglang.srt.arg_groups.model_override_base import use_mla_backend

        if model_path not in ("dummy", "none") and use_mla_backend(server_args):
            return None
    except Exception:  # the model is SGLang's to report on; the pool checks again
        pass
    return dtype


def _loses_scales(found: str | None) -> bool:
    """Whether SGLang ``found`` has an MXFP8 KV pool but no block-scaled host pool."""
    return found is not None and releases.release(found) < releases.release(
        releases.FIRST_SGLANG_MXFP8_HOST
    )


def _refuse_on_this_release(found: str | None) -> None:
    """On an SGLang this package does not serve: no host pool hook, one log
    line, and the refusal of block-scaled KV with HiCache at startup."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    reason = unserved_release_reason(found)
    (logger.error if _loses_scales(found) else logger.warning)(
        "%s Not installing the block-scaled host pool; a launch with a "
        "block-scaled --kv-cache-dtype and --enable-hierarchical-cache is refused.",
        reason,
    )
    resolves_once = found is None or releases.release(found) >= releases.release(
        releases.FIRST_RESOLVE_ONCE
    )
    target = hooks.SERVER_ARGS_HOOK_TARGET
    if not resolves_once:
        target = target.replace("resolve_once", "__post_init__")
    HookRegistry.register(target, refuse_on_unserved_release, HookType.AFTER)


def refuse_unserved_flags(result: Any, server_args: Any, *args: Any, **kwargs: Any):
    """AFTER hook on ``ServerArgs.resolve_once``, in every launcher before a
    model loads: a bad setting, or flags our pool would refuse
    (``refusals.REFUSALS``), stop the launch with the pool's reason."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_mxfp8_hicache.refusals import HiCacheFlags, refusal

    view = resolving_view(server_args)
    dtype = _block_scaled_hicache(server_args, view)
    if dtype is not None:
        settings.current()  # a variable's bad value stops the launch here
        refused = refusal(HiCacheFlags.from_server_args(view))
        if refused is not None:
            raise refused.error(dtype)
    return result


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``; idempotent."""
    global _registered, _refusing
    if _registered:
        return
    try:
        disabled = settings.current().disable
    except BlockScaledHiCacheConfigError as exc:  # refused again at launch
        logger.error(
            "%s A launch with a block-scaled --kv-cache-dtype and "
            "--enable-hierarchical-cache is refused until it is fixed.",
            exc,
        )
        disabled = False
    if disabled:
        logger.info(
            "sglang-mxfp8-hicache disabled by SGLANG_MXFP8_HICACHE_DISABLE; "
            "SGLang picks its own host pool."
        )
        return
    found = releases.sglang_version()
    if found not in releases.SUPPORTED_SGLANG_VERSIONS:
        if not _refusing:
            _refuse_on_this_release(found)
            _refusing = True
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in hooks.served_hooks():
        HookRegistry.register(hook.target, hook.function(), HookType[hook.hook_type])
    _registered = True
