"""The compressed replica sync's packing (fast; the sync itself runs in test_mics.py on 2 hosts x 2)."""
import pytest
import torch

from trainyard.engine.distributed.replica_sync import INT8_GROUP, pack, unpack


@pytest.mark.parametrize("n", [1, INT8_GROUP, 3 * INT8_GROUP + 17])
def test_int8_round_trip_is_within_half_a_step_of_each_group(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 2, n)
    packed = pack(x, "int8")
    groups = -(-n // INT8_GROUP)
    assert packed.dtype == torch.uint8 and packed.numel() == groups * INT8_GROUP + 4 * groups  # ~1/4 of fp32
    back = unpack(packed, "int8", n)
    assert back.shape == x.shape
    for g in range(groups):
        part = slice(g * INT8_GROUP, min(n, (g + 1) * INT8_GROUP))
        step = x[part].abs().max() / 127
        assert (back[part] - x[part]).abs().max() <= step / 2 * (1 + 1e-6)


def test_zeros_and_bf16():
    assert torch.equal(unpack(pack(torch.zeros(700), "int8"), "int8", 700), torch.zeros(700))
    x = torch.randn(1000)
    packed = pack(x, "bf16")
    assert packed.dtype == torch.bfloat16 and torch.equal(unpack(packed, "bf16", 1000), x.bfloat16().float())
