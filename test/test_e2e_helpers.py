"""The e2e run's own measuring sticks, checked on the CPU against SGLang's code."""

from __future__ import annotations

import torch
from sglang.kernels.ops.quantization.mxfp8_amd_gfx95 import (
    _mxfp8_e4m3_quantize_torch as sglang_reference_quantize,
)

from sglang_mxfp8_hicache.tools.bench import Row
from sglang_mxfp8_hicache.tools.e2e import dequantize, token_scales, within_mxfp8_error
from sglang_mxfp8_hicache.tools.selfcheck import build_device_pool, fill_random


def test_token_scales_match_sglang_reader():
    pool = build_device_pool(
        head_num=4, head_dim=128, layer_num=1, pages=3, device="cpu"
    )
    fill_random(pool.k_scale_buffer, torch.Generator().manual_seed(0))
    slots = torch.randperm(3 * 128, generator=torch.Generator().manual_seed(1)) + 128
    ours = token_scales(pool.k_scale_buffer[0], slots)
    theirs = pool._read_sf_interleaved(pool.k_scale_buffer[0], slots).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_dequantize_and_error_bound_catch_a_wrong_scale():
    x = (torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(2)) * 3).to(
        torch.bfloat16
    )
    values, scales = sglang_reference_quantize(x)
    deq = dequantize(values, scales)
    assert within_mxfp8_error(x.float(), deq, scales)
    # 2^(scale - 127): a scale byte of 127 is 1.0, 130 is 8.0.
    one = torch.ones(1, 32, dtype=torch.float8_e4m3fn)
    assert torch.equal(
        dequantize(one, torch.tensor([[130]], dtype=torch.uint8)),
        torch.full((1, 32), 8.0),
    )
    wrong = scales.clone()
    wrong[0, 0, 0] += 1
    assert not within_mxfp8_error(x.float(), dequantize(values, wrong), wrong)


def test_bench_goal_needs_ratio_and_not_slower_than_sglang():
    row = Row(8, 128, 8, 64, "backup", {"ours": 1.03, "sglang": 1.10, "payload": 1.0})
    assert row.goal() == 1.04 and row.meets_goal()
    assert Row(8, 128, 8, 16, "load", {"ours": 1.2, "payload": 1.0}).goal() == 1.25
    assert Row(8, 128, 8, 1, "load", {"ours": 1.2, "payload": 1.0}).goal() == 1.5
    # Within the ratio but slower than SGLang's own class: not met.
    assert not Row(
        8, 128, 8, 4, "backup", {"ours": 1.1, "sglang": 1.05, "payload": 1.0}
    ).meets_goal()
    assert not Row(8, 128, 8, 64, "load", {"ours": 1.06, "payload": 1.0}).meets_goal()


def test_bench_layer0_goal():
    """A load also needs layer 0 ready within 1.10x payload-only from 64 pages
    and never later than SGLang's class."""
    whole = {"ours": 1.0, "sglang": 1.1, "payload": 1.0}
    fast = {"ours": 0.105, "sglang": 0.2, "payload": 0.1}
    assert Row(8, 128, 80, 64, "load", whole, fast).meets_goal()
    slow = {"ours": 0.12, "sglang": 0.2, "payload": 0.1}
    assert not Row(8, 128, 80, 64, "load", whole, slow).meets_goal()
    # Below 64 pages only SGLang's class bounds layer 0.
    assert Row(8, 128, 80, 1, "load", whole, slow).meets_goal()
    later = {"ours": 0.12, "sglang": 0.11, "payload": 0.1}
    assert not Row(8, 128, 80, 1, "load", whole, later).meets_goal()
