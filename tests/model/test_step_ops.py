"""The step's two-form operations (model/step_ops.py): in PyTorch they compute what the exported graph's form
computes."""

import pytest
import torch

from specrt.contract import rotate_half_matrix
from specrt.model.step_ops import grouped_matmul, rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_rotation_without_a_matmul_gives_the_matmuls_numbers_bit_for_bit(dtype):
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(rotated(x, torch.from_numpy(rotate_half_matrix(64)).to(dtype)),
                       torch.matmul(x, torch.from_numpy(rotate_half_matrix(64)).to(dtype)))


def test_query_heads_as_rows_of_one_product_give_the_broadcast_product():
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(2, 3, 4, 5, 16, generator=g), torch.randn(2, 3, 16, 40, generator=g)  # G=4 heads per KV head
    want = torch.matmul(q, keys.unsqueeze(2))  # [2, 3, 4, 5, 40]
    got = grouped_matmul(q, keys)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
