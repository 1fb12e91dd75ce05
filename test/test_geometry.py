import pytest
import torch

from sglang_mxfp8_hicache.geometry import FP4_MX_BLOCK16, NVFP4, ScaleGeometry
from sglang_mxfp8_hicache.sizing import ModelGeometry, SizingError, host_plan


@pytest.mark.parametrize(
    "heads, head_dim, page_bytes, row_tokens",
    [
        (1, 128, 512, 128),
        (8, 128, 4096, 16),
        (32, 128, 16384, 4),
        (8, 256, 8192, 8),
        (2, 64, 512, 128),
        (64, 128, 32768, 2),
        (64, 256, 65536, 1),
    ],
)
def test_scale_page_bytes(heads, head_dim, page_bytes, row_tokens):
    geometry = ScaleGeometry(head_num=heads, head_dim=head_dim, page_size=128)
    assert geometry.page_bytes == page_bytes
    assert geometry.bytes_per_token * 128 == page_bytes
    # One scale byte per 32 payload bytes.
    assert geometry.payload_bytes_per_token == 32 * geometry.bytes_per_token
    assert geometry.host_bytes(page_num=10, layer_num=3) == 2 * 10 * 3 * page_bytes
    # Rows are the fewest tokens whose scales fill a multiple of 512 B.
    assert geometry.row_tokens == row_tokens
    assert geometry.row_bytes == max(512, geometry.bytes_per_token)
    assert geometry.row_bytes * geometry.rows_per_page == page_bytes


def test_host_page_layer_is_device_byte_order():
    geometry = ScaleGeometry(head_num=8, head_dim=128, page_size=128)
    layers = 3
    device = torch.randint(0, 256, (layers, 5, geometry.page_bytes), dtype=torch.uint8)
    # What the kernel writes: row j of layer l to host (page, j, l).
    host = (
        device.view(layers, 5, geometry.rows_per_page, geometry.row_bytes)
        .permute(1, 2, 0, 3)
        .contiguous()
    )
    for layer in range(layers):
        assert torch.equal(geometry.host_page_layer(host, layer), device[layer])
        assert torch.equal(geometry.host_page_layer(host[2], layer), device[layer, 2])


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
        ModelGeometry(layers=32, kv_heads=8, head_dim=128),
        1,
        65536,
        2048,
    ),
    "qwen3-32b": (ModelGeometry(layers=64, kv_heads=8, head_dim=128), 1, 131072, 4096),
    # 8 KV heads over TP 8: one head per rank.
    "llama-3.1-70b-tp8": (
        ModelGeometry(layers=80, kv_heads=8, head_dim=128),
        8,
        20480,
        640,
    ),
}


@pytest.mark.parametrize("name", MODELS)
def test_bytes_per_token(name):
    model, tp, payload, scales = MODELS[name]
    plan = host_plan(model, tp_size=tp, device_tokens=100_000, hicache_ratio=2.0)
    assert plan.payload_bytes_per_token == payload
    assert plan.scale_bytes_per_token == scales
    assert plan.bytes_per_token == payload + scales


def test_host_tokens_from_size_and_ratio():
    model = MODELS["llama-3.1-8b"][0]
    # --hicache-size 0.5: int(0.5e9 // 67584) = 7398 tokens -> 57 pages + 1 padding.
    plan = host_plan(model, tp_size=1, device_tokens=100_000, hicache_size_gb=0.5)
    assert plan.host_tokens == 58 * 128
    assert plan.host_bytes == 58 * 128 * 67584
    # Payload-only sizing would have given int(0.5e9 // 65536) = 7629 -> 59 + 1 pages.
    assert plan.host_tokens_without_scales == 60 * 128
    # --hicache-ratio 2 over 1000 device tokens: 2000 -> 15 pages + 1 padding.
    plan = host_plan(model, tp_size=1, device_tokens=1000, hicache_ratio=2.0)
    assert plan.host_tokens == 16 * 128
    assert plan.host_bytes == 16 * 128 * 67584


def test_tp_must_divide_or_replicate_heads():
    with pytest.raises(ValueError, match="--tp-size"):
        host_plan(
            ModelGeometry(layers=2, kv_heads=8, head_dim=128),
            tp_size=3,
            device_tokens=1,
            hicache_ratio=1.0,
        )


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
@pytest.mark.parametrize(
    "heads, page_size, page_bytes, row_tokens",
    [(8, 128, 8192, 8), (1, 128, 1024, 64), (8, 64, 4096, 8), (2, 16, 256, 16)],
)
def test_fp4_scale_page_bytes(fmt, heads, page_size, page_bytes, row_tokens):
    """One scale byte per 16 elements and half a byte of payload per element:
    a page holds one scale byte per 16 of its elements."""
    geometry = ScaleGeometry(head_num=heads, head_dim=128, page_size=page_size, fmt=fmt)
    assert geometry.page_bytes == page_bytes
    assert geometry.payload_head_bytes == 64
    assert geometry.payload_bytes_per_token == 8 * geometry.bytes_per_token
    assert geometry.row_tokens == row_tokens
    assert geometry.row_bytes * geometry.rows_per_page == page_bytes
    assert geometry.storage_format_tag(layer_num=3, version=1).startswith(
        f"{fmt.name}v1-l3h{heads}d128p{page_size}"
    )


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
def test_fp4_host_plan_matches_the_device_cell(fmt):
    """32 layers of 8x128: SGLang's device cell is 36,864 B per token (payload
    32,768 + scales 4,096; scaled-kv-formats 3.1), where its host formula,
    from MHABufferInfo's uint8 with the logical head_dim, says 65,536."""
    model = ModelGeometry(layers=32, kv_heads=8, head_dim=128)
    plan = host_plan(model, tp_size=1, device_tokens=1000, fmt=fmt, page_size=64)
    assert plan.payload_bytes_per_token == 32768
    assert plan.scale_bytes_per_token == 4096
    assert plan.host_tokens == (2000 // 64 + 1) * 64


def test_host_plan_refuses_what_the_format_cannot_serve():
    model = ModelGeometry(layers=2, kv_heads=8, head_dim=128)
    with pytest.raises(SizingError, match="mxfp8 HiCache needs --page-size 128"):
        host_plan(model, tp_size=1, device_tokens=1, page_size=64)
    with pytest.raises(SizingError, match="multiple of 32"):
        host_plan(
            ModelGeometry(layers=2, kv_heads=8, head_dim=80),
            tp_size=1,
            device_tokens=1,
        )


@pytest.mark.parametrize("fmt", [FP4_MX_BLOCK16, NVFP4], ids=lambda f: f.name)
def test_host_plan_refuses_fp4_rows_the_pool_refuses(fmt):
    """8 KV heads over TP 8 in FP4: a 64 B payload row per token, which the
    host pool refuses (test_host_pool); MXFP8's 128 B row is served."""
    model = ModelGeometry(layers=2, kv_heads=8, head_dim=128)
    with pytest.raises(SizingError, match="64 B .* lower --tp-size"):
        host_plan(model, tp_size=8, device_tokens=1, fmt=fmt)
    assert host_plan(model, tp_size=4, device_tokens=1, fmt=fmt).kv_heads_per_rank == 2
    assert host_plan(model, tp_size=8, device_tokens=1).payload_bytes_per_token == 512
