"""Behaviour of PageAllocator: all-or-nothing alloc, loud errors on bad frees."""

from __future__ import annotations

import pytest

from radix import PageAllocator


def test_fresh_allocator_hands_out_low_ids_first_and_counts_them() -> None:
    allocator = PageAllocator(4)
    assert allocator.alloc(3) == [0, 1, 2]
    assert (allocator.num_free, allocator.num_pages, allocator.num_used) == (1, 4, 3)


def test_alloc_more_than_free_returns_none_and_takes_nothing() -> None:
    allocator = PageAllocator(2)
    assert allocator.alloc(3) is None
    assert allocator.num_free == 2
    assert allocator.alloc(0) == []


def test_freed_pages_can_be_allocated_again() -> None:
    allocator = PageAllocator(3)
    pages = allocator.alloc(3)
    assert pages is not None
    allocator.free(pages[1:])
    assert sorted(allocator.alloc(2) or []) == [1, 2]
    assert allocator.num_free == 0


def test_double_free_raises_and_frees_nothing() -> None:
    allocator = PageAllocator(3)
    allocator.alloc(2)
    allocator.free([0])
    with pytest.raises(ValueError, match="double free of page 0"):
        allocator.free([1, 0])
    assert allocator.num_free == 2
    with pytest.raises(ValueError, match="twice"):
        allocator.free([1, 1])


@pytest.mark.parametrize("pages", [[3], [-1], [1.0], ["0"]])
def test_freeing_an_unknown_page_raises(pages: list[object]) -> None:
    allocator = PageAllocator(3)
    allocator.alloc(3)
    with pytest.raises(ValueError, match="pages"):
        allocator.free(pages)  # type: ignore[arg-type]
    assert allocator.num_free == 0


@pytest.mark.parametrize("num_pages", [-1, 2.0, None])
def test_bad_size_raises(num_pages: object) -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages)  # type: ignore[arg-type]


def test_negative_alloc_raises() -> None:
    with pytest.raises(ValueError, match="n: must be"):
        PageAllocator(1).alloc(-1)
