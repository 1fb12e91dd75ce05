"""The plugin's hooks on a served release as a table, and which of them
SGLang's registry applied: SGLang logs a target it cannot resolve and goes
on, so the pool (one log line) and ``check`` say what a missing one costs,
and a missing one that could make pages wrong refuses the pool."""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import msgspec

from sglang_mxfp8_hicache import releases
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

SERVER_ARGS_HOOK_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"


class Hook(NamedTuple):
    """One hook: SGLang's target, our function, and what a launch without it gets."""

    target: str
    function_name: str
    """``module:function``, resolved when the plugin registers it."""
    if_missing: str
    pages_wrong: bool = False
    """Pages could restore wrong without it: the pool refuses to be built."""
    hook_type: Literal["AROUND", "AFTER"] = "AROUND"

    def function(self) -> Callable[..., Any]:
        return pkgutil.resolve_name(self.function_name)


class HookState(msgspec.Struct, frozen=True):
    """Whether SGLang's registry applied one of our hooks in this process;
    ``check`` reads these from a fresh process, the pool logs them."""

    target: str
    in_force: bool
    if_missing: str
    pages_wrong: bool


def served_hooks() -> list[Hook]:
    """Every hook on a served release (the plugin registers them in order)."""
    from sglang_mxfp8_hicache import storage

    mem, host, hybrid = "sglang.srt.mem_cache.", "pool_host.mha.", "hybrid_cache."
    ours = "sglang_mxfp8_hicache.plugin:"
    staging_late = "staging taken after SGLang sized the KV pool, beside its own"
    indices = "host indices moved to the GPU: transfers by SM kernel, not copy engine"
    table = [
        Hook(
            mem + host + "get_mha_host_pool_cls",
            ours + "select_host_pool_cls",
            "SGLang's own host pool: FP4 scales not kept",
            pages_wrong=True,
        ),
        Hook(
            mem + hybrid + "hybrid_pool_assembler._mha_host_inputs",
            ours + "refuse_native_fp4_scales",
            "nvfp4's native trtllm_mha scales not refused, restored stale",
            pages_wrong=True,
        ),
        Hook(
            storage.FACTORY_HOOK_TARGET,
            "sglang_mxfp8_hicache.storage:guard_storage_backend",
            "L3 pages read without their size and seal checks",
            pages_wrong=True,
        ),
        Hook(
            mem + host + "prepare_mha_write_back_staging",
            ours + "skip_payload_staging",
            staging_late,
        ),
        Hook(
            mem + "kv_cache_builder.prepare_hicache_staging",
            ours + "mark_staging_preparation",
            staging_late,
        ),
        Hook(
            SERVER_ARGS_HOOK_TARGET,
            ours + "refuse_unserved_flags",
            "bad settings and flags refused only after the model loads",
            hook_type="AFTER",
        ),
        Hook(
            "sglang.srt.managers.cache_controller.HiCacheController.move_indices",
            ours + "keep_host_indices_on_cpu",
            indices,
        ),
        Hook(
            mem + hybrid + "hybrid_cache_controller.HybridCacheController."
            "_move_pool_indices",
            ours + "keep_pool_host_indices_on_cpu",
            indices + " (hybrid stacks)",
        ),
    ]
    if releases.builds_from_device_pool():  # no _mha_host_inputs: the selector refuses
        del table[1]
    return table


def hook_states() -> list[HookState]:
    """Each served hook, in force where SGLang's registry holds it for its
    target and has applied that target in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    def applied(hook: Hook) -> bool:
        registered = HookRegistry._hooks.get(hook.target, ())
        ours = any(fn is hook.function() for _, fn, _ in registered)
        return ours and hook.target in HookRegistry._patched

    return [
        HookState(h.target, applied(h), h.if_missing, h.pages_wrong)
        for h in served_hooks()
    ]


def hooks_in_force() -> str:
    """The pool's account of the hooks: all in force, or each missing one and
    what it costs. Raises if a missing one could make pages wrong; a pool
    built where SGLang applied none of them (outside ``load_plugins``) is
    not checked."""
    states = hook_states()
    missing = [s for s in states if not s.in_force]
    if len(missing) == len(states):
        return "plugin hooks not applied in this process"
    wrong = [s.target for s in missing if s.pages_wrong]
    if wrong:
        raise BlockScaledHiCacheConfigError(
            f"SGLang did not apply sglang-mxfp8-hicache's hook on {', '.join(wrong)}"
            " (its log says why); without it block-scaled pages could restore "
            "wrong. Reinstall sglang, or set SGLANG_MXFP8_HICACHE_DISABLE=1."
        )
    if not missing:
        return f"all {len(states)} plugin hooks in force"
    costs = "; ".join(f"{s.target.rsplit('.', 1)[-1]}: {s.if_missing}" for s in missing)
    return f"plugin hooks missing: {costs}"
