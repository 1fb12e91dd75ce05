import pytest

from sglang_mxfp8_hicache.geometry import FP4_MX_BLOCK16, NVFP4, ScaleGeometry
from sglang_mxfp8_hicache.page import HostPage
from sglang_mxfp8_hicache.tools.sizing import SizingError, dense_model, host_plan


def pool_plan(model: dict, tp_size: int = 1, **kwargs):
    """The one pool of a dense model's plan."""
    [pool] = host_plan(dense_model(**model, tp_size=tp_size), **kwargs).pools
    return pool


@pytest.mark.parametrize(
    "heads, head_dim, page_bytes",
    [
        (1, 128, 512),
        (8, 128, 4096),
        (32, 128, 16384),
        (8, 256, 8192),
        (2, 64, 512),
        (64, 256, 65536),
    ],
)
def test_scale_page_bytes(heads, head_dim, page_bytes):
    geometry = ScaleGeometry(head_num=heads, head_dim=head_dim, page_size=128)
    assert geometry.page_bytes == page_bytes
    assert geometry.bytes_per_token * 128 == page_bytes
    # One scale byte per 32 payload bytes.
    assert geometry.payload_bytes_per_token == 32 * geometry.bytes_per_token
    assert geometry.payload_page_bytes == 32 * page_bytes


def test_host_page_byte_order():
    """A page is K then V; each is, layer by layer, the payload run then the
    scale run of that layer's device page, then a seal area up to whole 4 KiB
    blocks (K: 3 layers of 202,752 B are 148.5 blocks, so 2,048 B; V: 3 of
    135,168 B are 99, so a whole block)."""
    k = ScaleGeometry(head_num=8, head_dim=192, page_size=128)
    v = ScaleGeometry(head_num=8, head_dim=128, page_size=128)
    page = HostPage(k, v, layer_num=3)
    k_layer = 128 * 8 * 192 + 128 * 8 * 6
    v_layer = 128 * 8 * 128 + 128 * 8 * 4
    k_seal, v_seal = 2048, 4096
    assert (page.k_part.seal_bytes, page.v_part.seal_bytes) == (k_seal, v_seal)
    assert page.seal_bytes == k_seal + v_seal
    assert page.k_part.span_bytes == 3 * k_layer + k_seal == 149 * 4096
    assert page.span_bytes == 3 * (k_layer + v_layer) + k_seal + v_seal
    assert page.run_bytes() == (128 * 8 * 192, 128 * 8 * 6, 128 * 8 * 128, 128 * 8 * 4)
    assert page.run_offsets(0) == (
        0,
        128 * 8 * 192,
        3 * k_layer + k_seal,
        3 * k_layer + k_seal + 128 * 8 * 128,
    )
    assert page.run_offsets(2)[1] == 2 * k_layer + 128 * 8 * 192
    assert page.bytes_per_token * 128 == page.span_bytes
    assert page.storage_format_tag() == "mxfp8v4-l3h8d192v128p128"
    # Every byte of the span belongs to exactly one run or one part's seal area.
    k_end = page.k_part.span_bytes
    seals = [(k_end - k_seal, k_end), (page.span_bytes - v_seal, page.span_bytes)]
    covered = sorted(
        [
            (off, off + size)
            for layer in range(3)
            for off, size in zip(page.run_offsets(layer), page.run_bytes(), strict=True)
        ]
        + seals
    )
    assert covered[0][0] == 0 and covered[-1][1] == page.span_bytes
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_num=0, head_dim=128, page_size=128), "head_num must be positive"),
        (dict(head_num=8, head_dim=100, page_size=128), "divisible by 32"),
        (
            dict(head_num=8, head_dim=40, page_size=64, fmt=NVFP4),
            "nvfp4 needs head_dim divisible by 16",
        ),
        (dict(head_num=8, head_dim=128, page_size=-1), "page_size must be positive"),
    ],
)
def test_geometry_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScaleGeometry(**kwargs)


# Hand-computed: payload 2 * heads * head_dim * layers, scales 2 * heads * head_dim / 32 * layers.
MODELS = {
    "llama-3.1-8b": (
        dict(layers=32, kv_heads=8, head_dim=128),
        1,
        65536,
        2048,
    ),
    "qwen3-32b": (dict(layers=64, kv_heads=8, head_dim=128), 1, 131072, 4096),
    # 8 KV heads over TP 8: one head per rank.
    "llama-3.1-70b-tp8": (
        dict(layers=80, kv_heads=8, head_dim=128),
        8,
        20480,
        640,
    ),
}


@pytest.mark.parametrize("name", MODELS)
def test_bytes_per_token(name):
    model, tp, payload, scales = MODELS[name]
    plan = pool_plan(model, tp, device_tokens=100_000, hicache_ratio=2.0)
    assert plan.payload_bytes_per_token == payload
    assert plan.scale_bytes_per_token == scales
    # Each part's layers are whole 4 KiB blocks: a block of seal area per part.
    assert plan.seal_bytes_per_token == 2 * 4096 // 128
    assert plan.bytes_per_token == payload + scales + 64


def test_host_tokens_from_size_and_ratio():
    model = MODELS["llama-3.1-8b"][0]
    # --hicache-size 1: int(1e9 // 67648) = 14782 tokens -> 115 pages + 1 padding
    # (67648 B per token: payload, scales and 64 B of seal areas).
    plan = pool_plan(model, 1, device_tokens=100_000, hicache_size_gb=1)
    assert plan.host_tokens == 116 * 128
    assert plan.host_bytes == 116 * 128 * 67648
    # Payload-only sizing would have given int(1e9 // 65536) = 15258 -> 119 + 1 pages.
    assert plan.host_tokens_without_scales == 120 * 128
    # --hicache-ratio 2 over 1000 device tokens: 2000 -> 15 pages + 1 padding.
    plan = pool_plan(model, 1, device_tokens=1000, hicache_ratio=2.0)
    assert plan.host_tokens == 16 * 128
    assert plan.host_bytes == 16 * 128 * 67648


def test_tp_must_divide_or_replicate_heads():
    with pytest.raises(ValueError, match="--tp-size"):
        pool_plan(
            dict(layers=2, kv_heads=8, head_dim=128),
            3,
            device_tokens=1,
            hicache_ratio=1.0,
        )


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
@pytest.mark.parametrize(
    "heads, page_size, page_bytes",
    [(8, 128, 8192), (1, 128, 1024), (8, 64, 4096), (2, 16, 256)],
)
def test_fp4_scale_page_bytes(fmt, heads, page_size, page_bytes):
    """One scale byte per 16 elements and half a byte of payload per element:
    a page holds one scale byte per 16 of its elements."""
    geometry = ScaleGeometry(head_num=heads, head_dim=128, page_size=page_size, fmt=fmt)
    assert geometry.page_bytes == page_bytes
    assert geometry.payload_head_bytes == 64
    assert geometry.payload_bytes_per_token == 8 * geometry.bytes_per_token
    page = HostPage(geometry, geometry, layer_num=3)
    assert page.storage_format_tag() == f"{fmt.name}v4-l3h{heads}d128p{page_size}"


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
def test_fp4_host_plan_matches_the_device_cell(fmt):
    """32 layers of 8x128: SGLang's device cell is 36,864 B per token (payload
    32,768 + scales 4,096; scaled-kv-formats 3.1), where its host formula,
    from MHABufferInfo's uint8 with the logical head_dim, says 65,536."""
    model = dict(layers=32, kv_heads=8, head_dim=128)
    plan = pool_plan(model, 1, device_tokens=1000, fmt=fmt, page_size=64)
    assert plan.payload_bytes_per_token == 32768
    assert plan.scale_bytes_per_token == 4096
    assert plan.host_tokens == (2000 // 64 + 1) * 64


def test_host_plan_refuses_what_the_format_cannot_serve():
    model = dict(layers=2, kv_heads=8, head_dim=128)
    with pytest.raises(SizingError, match="set --page-size 128"):
        pool_plan(model, 1, device_tokens=1, page_size=64)
    with pytest.raises(SizingError, match="multiple of 32"):
        pool_plan(
            dict(layers=2, kv_heads=8, head_dim=80),
            1,
            device_tokens=1,
        )


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
def test_host_plan_serves_narrow_fp4_rows(fmt):
    """8 KV heads over TP 8 in FP4: a 64 B payload row per token, which the
    host pool serves (page chunks are whole pages of rows)."""
    model = dict(layers=2, kv_heads=8, head_dim=128)
    plan = pool_plan(model, 8, device_tokens=1, fmt=fmt)
    assert plan.kv_heads == 1
    assert plan.payload_bytes_per_token == 2 * 2 * 64
    assert pool_plan(model, 8, device_tokens=1).payload_bytes_per_token == 512
