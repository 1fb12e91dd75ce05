"""``size``: the host tier per rank and per node, with and without the scale
bytes of a block-scaled format, as SGLang sizes its host pools.

A model, read through SGLang's ``ModelConfig``, gets the KV pools SGLang builds:
dense ``kv``; hybrid SWA ``full`` and ``swa`` (page-aligned
``--swa-full-tokens-ratio`` of the full pool's tokens); Mamba a ``kv`` pool of
its attention layers beside SGLang's Mamba host pool; MLA is refused. A pool's
host tier is ``HostKVCache.__init__``'s: its share of ``--hicache-size`` (as
``_split_hicache_size`` shares it) over its bytes per token, else device tokens
times ``--hicache-ratio``; whole pages plus one padding page.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from sglang_mxfp8_hicache import geometry
from sglang_mxfp8_hicache.geometry import FORMATS, MXFP8, ScaleFormat
from sglang_mxfp8_hicache.refusals import HiCacheFlags, PageShape, Refused, plan_page

PAGE_SIZE = geometry.INTERLEAVED_PAGE_SIZE
"""MXFP8's page size, and the default for the others."""
SMALLEST_SCALE_BLOCK = min(f.sf_block for f in FORMATS.values())
SCALED_HEAD_DIMS = "a multiple of the scale block: " + ", ".join(
    f"{f.sf_block} for {f.name}" for f in FORMATS.values()
)
SWA_FULL_TOKENS_RATIO = 0.8
"""SGLang's ``--swa-full-tokens-ratio`` when it is not given."""
HICACHE_RATIO = 2.0
"""SGLang's ``--hicache-ratio`` when it is not given."""
MODEL_BOUNDS = {"layers": 4096, "kv_heads": 4096, "head_dim": 8192}
"""The most a pool's count can be: ten times what released models have."""
TEXT_SUB_CONFIGS = ("thinker_config", "llm_config", "language_config", "text_config")
"""Where a multimodal config keeps its language model's, as SGLang looks for it."""
HOST_MEMORY_RESERVE_BYTES = 10 << 30
"""SGLang's ``HICACHE_HOST_MEMORY_RESERVE_BYTES``, kept out of its HiCache budget."""
MAX_NODE_HOST_BYTES = 64 << 40
"""More host tier than any server holds: a typo in the device tokens or ratio."""
MAX_DEVICE_BYTES = 1 << 40
"""More KV cache than one GPU holds (the largest: 288 GB): a typo in a count."""
MAX_PAGE_SIZE = 1 << 16
"""Tokens per page: 4x SGLang's largest default chunked prefill (16384 tokens)."""


class SizingError(ValueError):
    """A model or count that cannot be sized, in one line naming the value, where
    it came from and what is allowed: the CLI prints it as a usage error."""


def _positive_int(value: object, name: str) -> int:
    # bool is an int subclass, but `true` is no count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizingError(
            f"{name} must be a positive integer, got {value!r} ({type(value).__name__})"
        )
    if value <= 0:
        raise SizingError(f"{name} must be a positive integer, got {value}")
    return value


class KVPool(msgspec.Struct, frozen=True):
    """One KV pool SGLang builds for the model on one rank."""

    name: str
    """SGLang's pool label: ``kv``, ``full`` or ``swa``."""
    layers: int
    kv_heads: int
    """Per rank: split over TP ranks, or replicated when TP is larger."""
    head_dim: int
    v_head_dim: int
    token_ratio: float = 1.0
    """Device tokens per token of the full (or only) pool."""


class ModelKV(msgspec.Struct, frozen=True):
    """The KV pools of a model on one rank, and its Mamba state per request."""

    pools: tuple[KVPool, ...]
    mamba_state_bytes: int = 0
    source: str = "flags"


def kv_heads_per_rank(kv_heads: int, tp_size: int) -> int:
    """SGLang splits KV heads over TP ranks, or replicates them when TP is larger."""
    _positive_int(kv_heads, "kv_heads")
    _positive_int(tp_size, "--tp-size")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise SizingError(
            f"--tp-size {tp_size} must divide the {kv_heads} KV heads or be a "
            f"multiple of {kv_heads}"
        )
    return max(1, kv_heads // tp_size)


def dense_model(*, layers: int, kv_heads: int, head_dim: int, tp_size: int) -> ModelKV:
    """A dense MHA model given by its counts (``size --layers ...``)."""
    _positive_int(layers, "--layers")
    _positive_int(head_dim, "--head-dim")
    heads = kv_heads_per_rank(kv_heads, tp_size)
    return ModelKV((KVPool("kv", layers, heads, head_dim, head_dim),))


def read_model(
    path: str | Path,
    *,
    tp_size: int,
    swa_full_tokens_ratio: float = SWA_FULL_TOKENS_RATIO,
) -> ModelKV:
    """The KV pools SGLang builds for the model at ``path`` (a directory or any
    JSON config file), read by ``ModelConfig`` from a copy without its
    ``quantization_config`` (weights leave the KV cache alone, and SGLang knows
    gpt-oss's ``mxfp4`` only beside an accelerator); the layer count must be given."""
    path = Path(path)
    config_file = path if path.is_file() else path / "config.json"
    try:
        config = json.loads(config_file.read_bytes())
    except OSError as exc:
        raise SizingError(f"{config_file}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise SizingError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SizingError(
            f"{config_file}: expected a JSON object, got a {type(config).__name__}"
        )
    with tempfile.TemporaryDirectory() as model_dir:
        copy = Path(model_dir) / "config.json"
        try:
            copy.write_text(json.dumps(_without_weight_quantization(config)))
            return _read_model_config(
                Path(model_dir), config, tp_size, swa_full_tokens_ratio
            )
        except SizingError as exc:
            raise SizingError(f"{config_file}: {exc}") from None
        except Exception as exc:  # SGLang's and transformers' own complaints
            # They name the copy's folder, which the user never made.
            said = str(exc).replace(str(copy), str(config_file))
            said = between_words(said.replace(model_dir, str(config_file)), 300)
            raise SizingError(
                f"{config_file}: SGLang's ModelConfig cannot read it "
                f"({type(exc).__name__}: {said})"
            ) from None


def between_words(text: str, limit: int) -> str:
    """``text`` on one line, cut before ``limit`` characters at a space in its
    last quarter, else at ``limit`` (a long path keeps its start), marked " ..."."""
    text = " ".join(text.split())  # one line
    cut = text.rfind(" ", limit * 3 // 4, limit)
    return text if len(text) <= limit else text[: cut if cut > 0 else limit] + " ..."


def _without_weight_quantization(config: dict) -> dict:
    """``config`` without the ``quantization_config`` of it and of its sub-configs."""
    return {
        key: _without_weight_quantization(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if key != "quantization_config"
    }


def _check_layer_count(text_config: Any, config: dict) -> None:
    """Refuses a layer count that ``config`` (the JSON as written) does not
    give, at its top or in a text sub-config, or that is not positive."""
    layers = "num_hidden_layers"
    field = type(text_config).attribute_map.get(layers, layers)

    def gives(config: object) -> bool:
        if not isinstance(config, dict):
            return False
        return field in config or any(gives(config.get(k)) for k in TEXT_SUB_CONFIGS)

    if not gives(config):
        raise SizingError(f"{field} is missing: give the model's layer count")
    _positive_int(getattr(text_config, field), field)


def _read_model_config(
    model_dir: Path, config: dict, tp_size: int, swa_full_tokens_ratio: float
) -> ModelKV:
    """The pools of ``model_dir``'s ``ModelConfig``, read as a scheduler of
    ``tp_size`` ranks reads it; ``config`` is the JSON as its owner wrote it."""
    with warnings.catch_warnings():
        # SGLang's quantization registry warns, on import, about GPUs it lacks.
        warnings.simplefilter("ignore", UserWarning)
        from sglang.srt.configs.model_config import AttentionArch

    with _sglang_context(tp_size):
        from sglang.srt.configs.hybrid_arch import mambaish_config
        from sglang.srt.configs.model_config import ModelConfig

        model = ModelConfig(model_path=str(model_dir))
        _check_layer_count(model.hf_text_config, config)
        if model.attention_arch == AttentionArch.MLA:
            raise SizingError(
                "an MLA model (latent KV, as DeepSeek-V3): SGLang gives it an MLA "
                "KV pool, and block-scaled HiCache serves MHA pools only"
            )
        for name in ("num_key_value_heads", "num_attention_heads"):
            value = getattr(model.hf_text_config, name, None)
            if value is not None:  # SGLang reads 0 or fewer heads as 1
                _positive_int(value, name)
        kv_heads_per_rank(model.get_num_kv_heads(1), tp_size)
        heads = model.get_num_kv_heads(tp_size)
        arch = (model.hf_config.architectures or ["?"])[0]
        dims = (model.head_dim, model.v_head_dim)
        if model.is_hybrid_swa:
            swa = (model.get_swa_num_kv_heads(tp_size), model.swa_head_dim)
            swa += (model.swa_v_head_dim, swa_full_tokens_ratio)
            pools = (
                KVPool("full", len(model.full_attention_layer_ids), heads, *dims),
                KVPool("swa", len(model.swa_attention_layer_ids), *swa),
            )
            # A layer kind the config never uses leaves its pool empty: no host tier.
            empty = "".join(f": no {p.name} layers" for p in pools if not p.layers)
            pools = tuple(p for p in pools if p.layers)
            return ModelKV(pools, source=f"{arch} (hybrid SWA{empty})")
        mamba = mambaish_config(model)
        if mamba is not None:
            layers = len(mamba.full_attention_layer_ids)
            state = mamba.mamba2_cache_params.mamba_cache_per_req
            pool = KVPool("kv", layers, heads, *dims)
            return ModelKV((pool,), mamba_state_bytes=state, source=f"{arch} (Mamba)")
        pool = KVPool("kv", model.num_attention_layers, heads, *dims)
        return ModelKV((pool,), source=arch)


@contextlib.contextmanager
def _sglang_context(tp_size: int) -> Iterator[None]:
    """SGLang's runtime context for ``tp_size`` ranks while a config is read:
    some configs (Qwen3-Next's Mamba state) ask it for the TP size."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = ServerArgs(model_path="dummy", tp_size=tp_size)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield
    finally:
        reset_context()


class PoolPlan(msgspec.Struct, frozen=True):
    """One KV pool's host tier on one rank."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    device_tokens: int
    payload_bytes_per_token: int
    scale_bytes_per_token: int
    seal_bytes_per_token: int
    bytes_per_token: int
    """The host pool's ``get_size_per_token()``: payload, scales and seals."""
    host_tokens: int
    host_bytes: int
    host_tokens_without_scales: int
    host_bytes_without_scales: int
    """What a payload-only host pool would have allocated."""


class HostPlan(msgspec.Struct, frozen=True):
    """The host tier of one rank and of one node, written by ``size --json``."""

    kv_cache_dtype: str
    page_size: int
    tp_size: int
    ranks_per_node: int
    source: str
    pools: tuple[PoolPlan, ...]
    host_bytes: int
    host_bytes_without_scales: int
    host_bytes_per_node: int
    mamba_state_bytes: int
    """Per request slot and rank; SGLang's Mamba host pool holds these apart."""
    warnings: tuple[str, ...]
    host_budget_per_rank: int | None = None
    """SGLang's (available memory less its reserve, over the node's ranks) on the
    machine ``host_budget_of`` names; None where it is not known."""
    host_budget_of: str = ""


def _bytes_per_token(pool: KVPool, flags: HiCacheFlags) -> tuple[int, int, int]:
    """Payload, scale and seal bytes per token of the page the host pool of
    ``pool`` builds (``refusals.plan_page``); its refusal as a ``SizingError``."""
    counts = {"layers": pool.layers, "kv_heads": pool.kv_heads}
    counts["head_dim"] = max(pool.head_dim, pool.v_head_dim)
    for name, value in counts.items():
        if value > MODEL_BOUNDS[name]:
            raise SizingError(
                f"{pool.name} pool: {name} {value} is over {MODEL_BOUNDS[name]}, "
                "ten times what any released model has: a typo?"
            )
    shape = PageShape(pool.kv_heads, pool.head_dim, pool.v_head_dim, pool.layers)
    page = plan_page(flags, shape)
    if isinstance(page, Refused):
        raise SizingError(f"{pool.name} pool: {page.reason}")
    seals = page.seal_bytes // flags.page_size
    scales = page.scale_bytes_per_token
    return page.bytes_per_token - scales - seals, scales, seals


def _size_shares(
    model: ModelKV,
    device_bytes: list[int],
    hicache_size_gb: float,
    max_mamba_cache_size: int | None,
) -> list[float]:
    """Each pool's GB of ``--hicache-size``: all of it for a lone pool, else a
    share in proportion to device bytes, the Mamba state's included."""
    if not (hicache_size_gb > 0 and (len(device_bytes) > 1 or model.mamba_state_bytes)):
        return [float(hicache_size_gb)] * len(device_bytes)
    shares = list(device_bytes)
    if model.mamba_state_bytes:
        if max_mamba_cache_size is None:
            raise SizingError(
                f"{model.source}: --hicache-size is shared with the Mamba "
                "state pool in proportion to device bytes; give its device "
                "slots as --max-mamba-cache-size"
            )
        shares.append((max_mamba_cache_size + 1) * model.mamba_state_bytes)
    return [hicache_size_gb * b / sum(shares) for b in device_bytes]


def _check_device_bytes(
    model: ModelKV, device_bytes: list[int], max_mamba_cache_size: int | None
) -> None:
    """Refuses device pools (the Mamba state's included) that no GPU holds."""
    total = sum(device_bytes)
    total += ((max_mamba_cache_size or 0) + 1) * model.mamba_state_bytes
    if total > MAX_DEVICE_BYTES:
        raise SizingError(
            f"{total / 1e9:,.0f} GB of device pools per rank is more than any GPU "
            f"holds (the bound is {MAX_DEVICE_BYTES >> 40} TiB): check "
            "--device-tokens, --page-size and --max-mamba-cache-size"
        )


def host_plan(
    model: ModelKV,
    *,
    device_tokens: int,
    hicache_ratio: float = HICACHE_RATIO,
    hicache_size_gb: int = 0,
    fmt: ScaleFormat = MXFP8,
    page_size: int = PAGE_SIZE,
    tp_size: int = 1,
    ranks_per_node: int = 1,
    max_mamba_cache_size: int | None = None,
    draft_layers: int = 0,
    layout: str = "page_first",
) -> HostPlan:
    """``fmt``'s host tier for ``model`` on one rank, from ``device_tokens`` of
    the full (or only) KV pool. ``draft_layers``: packed MTP/NextN draft
    layers, which the full (or only) pool's page carries after the target's;
    ``layout``: ``--hicache-mem-layout`` (a ``page_head`` page has no seals)."""
    if draft_layers:
        first, *rest = model.pools
        first = msgspec.structs.replace(first, layers=first.layers + draft_layers)
        model = msgspec.structs.replace(model, pools=(first, *rest))
    flags = HiCacheFlags(fmt.name, page_size=page_size, mem_layout=layout)
    per_token = [_bytes_per_token(pool, flags) for pool in model.pools]
    # SGLang sizes the SWA pool as the page-aligned ratio of the full pool's tokens.
    pool_tokens = [
        device_tokens
        if pool.token_ratio == 1.0
        else int(device_tokens * pool.token_ratio) // page_size * page_size
        for pool in model.pools
    ]
    device_bytes = [
        (tokens + page_size) * (payload + scale)
        for tokens, (payload, scale, _) in zip(pool_tokens, per_token, strict=True)
    ]
    _check_device_bytes(model, device_bytes, max_mamba_cache_size)
    shares = _size_shares(model, device_bytes, hicache_size_gb, max_mamba_cache_size)

    def host_tokens(bytes_per_token: int, tokens: int, share_gb: float) -> int:
        """``HostKVCache``'s token count: whole pages plus one padding page."""
        if share_gb > 0:
            tokens = int(share_gb * 1e9 // bytes_per_token)
        else:
            tokens = int(tokens * hicache_ratio)
        return (tokens // page_size + 1) * page_size

    plans = []
    for pool, tokens, share, (payload, scale, seal) in zip(
        model.pools, pool_tokens, shares, per_token, strict=True
    ):
        total = payload + scale + seal
        with_scales = host_tokens(total, tokens, share)
        without = host_tokens(payload, tokens, share)
        plans.append(
            PoolPlan(
                name=pool.name,
                layers=pool.layers,
                kv_heads=pool.kv_heads,
                head_dim=pool.head_dim,
                v_head_dim=pool.v_head_dim,
                device_tokens=tokens,
                payload_bytes_per_token=payload,
                scale_bytes_per_token=scale,
                seal_bytes_per_token=seal,
                bytes_per_token=total,
                host_tokens=with_scales,
                host_bytes=with_scales * total,
                host_tokens_without_scales=without,
                host_bytes_without_scales=without * payload,
            )
        )
    rank_bytes = sum(p.host_bytes for p in plans)
    if (node_bytes := rank_bytes * ranks_per_node) > MAX_NODE_HOST_BYTES:
        raise SizingError(
            f"{node_bytes / 2**40:.0f} TiB of host tier per node is more RAM than "
            f"any server holds (the bound is {MAX_NODE_HOST_BYTES >> 40} TiB): "
            "check the device tokens, --hicache-ratio and --hicache-size"
        )
    return HostPlan(
        kv_cache_dtype=flags.kv_cache_dtype,
        page_size=flags.page_size,
        tp_size=tp_size,
        ranks_per_node=ranks_per_node,
        source=model.source,
        pools=tuple(plans),
        host_bytes=rank_bytes,
        host_bytes_per_node=node_bytes,
        host_bytes_without_scales=sum(p.host_bytes_without_scales for p in plans),
        mamba_state_bytes=model.mamba_state_bytes,
        warnings=tuple(
            f"the {p.name} host pool ({p.host_tokens} tokens) is not larger than its "
            f"device pool ({p.device_tokens} tokens): SGLang warns that L2 then helps "
            "little; raise --hicache-ratio or --hicache-size"
            for p in plans
            if p.host_tokens <= p.device_tokens
        ),
    )
