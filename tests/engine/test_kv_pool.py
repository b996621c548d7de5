"""KVPool: NHD page tensors addressed by radix page ids, sized by pages or bytes."""

from __future__ import annotations

import pytest
import torch

from engine.model.kv_pool import KVPool


def test_pages_have_flashinfer_nhd_layout_per_layer() -> None:
    pool = KVPool(3, 10, 16, 2, 8, torch.bfloat16)
    assert len(pool.k_cache) == len(pool.v_cache) == 3
    assert pool.k_cache[0].shape == (10, 16, 2, 8)
    assert pool.v_cache[2].dtype == torch.bfloat16
    assert pool.num_bytes == 2 * 3 * 10 * 16 * 2 * 8 * 2


def test_write_puts_each_token_at_page_and_offset_of_its_slot() -> None:
    pool = KVPool(2, 5, 4, 1, 2)
    slots = torch.tensor([4 * 3 + 1, 4 * 0 + 3])
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    pool.write(1, slots, k, -k)
    assert pool.k_cache[1][3, 1].tolist() == [[1.0, 2.0]]
    assert pool.v_cache[1][0, 3].tolist() == [[-3.0, -4.0]]
    assert pool.k_cache[0].abs().sum() == 0  # other layers untouched


def test_pages_for_bytes_counts_k_and_v_of_all_layers() -> None:
    per_page = 2 * 30 * 16 * 3 * 64 * 4
    assert KVPool.bytes_per_page(30, 16, 3, 64, torch.float32) == per_page
    assert KVPool.pages_for_bytes(per_page * 7 + 5, 30, 16, 3, 64, torch.float32) == 7
    assert KVPool.pages_for_bytes(per_page * 7, 30, 16, 3, 64, torch.bfloat16) == 14


@pytest.mark.parametrize(
    "field", ["num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"]
)
def test_nonpositive_sizes_raise_value_error_naming_the_field(field: str) -> None:
    sizes = {"num_layers": 1, "num_pages": 1, "page_size": 1, "num_kv_heads": 1, "head_dim": 1}
    sizes[field] = 0
    with pytest.raises(ValueError, match=field):
        KVPool(**sizes)


def test_negative_byte_budget_raises() -> None:
    with pytest.raises(ValueError, match="num_bytes"):
        KVPool.pages_for_bytes(-1, 1, 1, 1, 1, torch.float32)
