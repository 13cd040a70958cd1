"""BlockManager: page allocation, reservations, shared prefixes and their private copy page."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.block_manager import BlockManager, PageTable


def check_invariants(bm: BlockManager, tables: list[PageTable]) -> None:
    """Every page is either free (ref 0) or referenced exactly ref_count times by live tables."""
    assert len(set(bm.free_pages)) == len(bm.free_pages), "a page is on the free list twice"
    refs = [0] * bm.num_pages
    for table in tables:
        assert len(set(table.pages)) == len(table.pages), "a table holds a page twice"
        for page in table.pages:
            refs[page] += 1
    for page in range(bm.num_pages):
        if page in bm.free_pages:
            assert bm.ref_counts[page] == 0 and refs[page] == 0, f"free page {page} referenced"
        else:
            assert bm.ref_counts[page] == refs[page] > 0, f"page {page} ref count is wrong"
    assert bm.pages_in_use == bm.num_pages - len(bm.free_pages)
    assert bm.reserved == sum(t.reserved for t in tables)
    assert bm.pages_available >= 0
    for table in tables:
        assert len(table.pages) >= bm.pages_for(table.length)


def test_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_and_release() -> None:
    bm = BlockManager(8, 4)
    table = bm.allocate(10)
    assert table.length == 10 and len(table.pages) == 3 and table.reserved == 0
    assert bm.pages_in_use == 3 and len(bm.free_pages) == 5 and bm.pages_available == 5
    assert all(bm.ref_counts[p] == 1 for p in table.pages)
    check_invariants(bm, [table])
    bm.release(table)
    assert table.pages == [] and table.length == 0
    assert bm.pages_in_use == 0 and sorted(bm.free_pages) == list(range(8))
    assert bm.ref_counts == [0] * 8
    check_invariants(bm, [])


def test_allocate_exhausted_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    first = bm.allocate(12)  # 3 pages
    free_before = list(bm.free_pages)
    with pytest.raises(MemoryError):
        bm.allocate(5)  # 2 pages, 1 free
    assert bm.free_pages == free_before and bm.pages_in_use == 3
    check_invariants(bm, [first])
    # Reserved pages are not available to allocate either.
    table = PageTable()
    assert bm.reserve(table, 4)
    with pytest.raises(MemoryError):
        bm.allocate(1)
    check_invariants(bm, [first, table])


def test_reserve_then_extend_takes_pages_only_as_positions_arrive() -> None:
    bm = BlockManager(10, 4)
    table = PageTable()
    assert bm.reserve(table, 10)  # 3 pages promised
    assert table.reserved == 3 and bm.reserved == 3
    assert bm.pages_in_use == 0 and bm.pages_available == 7
    check_invariants(bm, [table])

    bm.extend(table, 1)
    assert len(table.pages) == 1 and table.reserved == 2 and bm.pages_in_use == 1
    bm.extend(table, 3)  # positions 1..3: still the first page
    assert len(table.pages) == 1 and table.length == 4
    bm.extend(table, 1)  # position 4 opens page 2
    assert len(table.pages) == 2 and table.reserved == 1
    bm.extend(table, 5)  # up to 10 positions: page 3
    assert len(table.pages) == 3 and table.reserved == 0 and bm.reserved == 0
    assert bm.pages_available == 7
    check_invariants(bm, [table])

    with pytest.raises(RuntimeError):
        bm.extend(table, 3)  # past the reservation

    bm.release(table)
    assert bm.pages_in_use == 0 and bm.reserved == 0 and bm.pages_available == 10


def test_release_returns_unused_reservation() -> None:
    bm = BlockManager(6, 4)
    table = PageTable()
    assert bm.reserve(table, 20)  # 5 pages
    bm.extend(table, 2)
    assert bm.pages_available == 1 and bm.reserved == 4
    bm.release(table)
    assert bm.reserved == 0 and bm.pages_available == 6 and bm.pages_in_use == 0


def test_reserve_fails_when_short_and_changes_nothing() -> None:
    bm = BlockManager(5, 4)
    voice = bm.allocate(8)  # 2 pages
    a = PageTable()
    assert bm.reserve(a, 8)  # 2 more: 1 left
    b = PageTable()
    assert not bm.reserve(b, 8)
    assert b.reserved == 0 and b.pages == [] and bm.reserved == 2
    assert bm.pages_available == 1
    assert bm.reserve(b, 4)  # exactly the last page
    assert bm.pages_available == 0
    c = PageTable()
    assert not bm.reserve(c, 1)
    check_invariants(bm, [voice, a, b, c])


def test_a_table_grows_its_reservation_and_rewrites_positions_it_truncated() -> None:
    """A draft's table: reserved for its tokens, then for its clause; truncated where the
    clause parts from it, its pages kept for the positions written again."""
    bm = BlockManager(8, 4)
    table = PageTable()
    assert bm.reserve(table, 6)  # 2 pages
    bm.extend(table, 6)
    assert bm.reserve(table, 6) and table.reserved == 0  # held already: nothing more promised
    assert bm.reserve(table, 13)  # 2 more
    assert table.reserved == 2 and bm.reserved == 2
    bm.truncate(table, 3)
    assert table.length == 3 and len(table.pages) == 2
    bm.extend(table, 10)  # positions 3..12: the second page again, then the two promised
    assert table.length == 13 and len(table.pages) == 4 and table.reserved == 0
    assert not bm.reserve(table, 13 + 4 * 5)  # 5 more pages: 4 are free
    check_invariants(bm, [table])
    bm.release(table)
    assert bm.pages_available == 8


def test_share_a_whole_page_prefix() -> None:
    bm = BlockManager(8, 4)
    voice = bm.allocate(8)  # exactly 2 pages
    table, partial = bm.share(voice)
    assert partial is None
    assert table.pages == voice.pages and table.length == 8
    assert all(bm.ref_counts[p] == 2 for p in voice.pages)
    assert bm.pages_in_use == 2
    assert bm.reserve(table, 13, copy_partial=False)  # 4 pages total: 2 new
    assert table.reserved == 2 and len(table.pages) == 2
    bm.extend(table, 5)
    assert len(table.pages) == 4 and table.pages[:2] == voice.pages
    check_invariants(bm, [voice, table])
    bm.release(table)
    assert all(bm.ref_counts[p] == 1 for p in voice.pages)
    assert bm.pages_in_use == 2
    check_invariants(bm, [voice])


def test_share_a_partial_last_page_gets_a_private_copy_page() -> None:
    bm = BlockManager(10, 4)
    voice = bm.allocate(10)  # pages: 2 full + 1 holding positions 8, 9
    full, last = voice.pages[:2], voice.pages[2]

    table, partial = bm.share(voice)
    assert partial == last
    assert table.pages == full and table.length == 10
    assert [bm.ref_counts[p] for p in full] == [2, 2]
    assert bm.ref_counts[last] == 1  # the partial page is never shared

    assert bm.reserve(table, 17, copy_partial=True)  # 5 pages: 2 shared + copy + 2 more
    assert len(table.pages) == 3
    private = table.pages[2]
    assert private not in voice.pages and bm.ref_counts[private] == 1
    assert table.reserved == 2 and bm.reserved == 2
    check_invariants(bm, [voice, table])

    # Positions 8, 9 of the new table live in its private page, at the same offsets.
    slots = bm.slots(table)
    assert slots[:8].tolist() == bm.slots(voice)[:8].tolist()
    assert slots[8:10].tolist() == [private * 4, private * 4 + 1]
    bm.extend(table, 7)
    assert table.length == 17 and len(table.pages) == 5 and table.reserved == 0
    assert bm.slots(table)[10:12].tolist() == [private * 4 + 2, private * 4 + 3]

    # A second sharer gets its own copy page.
    other, partial2 = bm.share(voice)
    assert partial2 == last
    assert bm.reserve(other, 11, copy_partial=True)
    assert other.pages[2] not in (private, last)
    assert [bm.ref_counts[p] for p in full] == [3, 3]
    check_invariants(bm, [voice, table, other])

    bm.release(table)
    bm.release(other)
    assert [bm.ref_counts[p] for p in voice.pages] == [1, 1, 1]
    assert bm.pages_in_use == 3 and bm.reserved == 0
    check_invariants(bm, [voice])
    bm.release(voice)
    assert bm.pages_in_use == 0 and sorted(bm.free_pages) == list(range(10))


def test_share_with_copy_needs_the_copy_page_reserved() -> None:
    bm = BlockManager(4, 4)
    voice = bm.allocate(6)  # 1 full page, 1 partial
    table, partial = bm.share(voice)
    assert partial is not None
    # 2 pages needed for 8 positions: the shared full page + the copy. 2 are free.
    assert bm.reserve(table, 8, copy_partial=True)
    assert bm.pages_available == 1
    other, _ = bm.share(voice)
    assert not bm.reserve(other, 13, copy_partial=True)  # 4 pages: 3 new, 1 free
    assert len(other.pages) == 1 and other.reserved == 0
    bm.release(other)
    check_invariants(bm, [voice, table])


def test_slots_follow_scattered_pages() -> None:
    bm = BlockManager(6, 3)
    bm.free_pages = [1, 5, 0, 3, 2, 4]  # taken from the end: 4, 2, 3, ...
    table = bm.allocate(7)
    assert table.pages == [4, 2, 3]
    assert bm.slots(table).tolist() == [12, 13, 14, 6, 7, 8, 9]
    assert bm.slots(table, 2, 5).tolist() == [14, 6, 7]
    assert bm.slots(table).dtype == torch.long


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["allocate", "share", "extend", "release"]), st.integers(0, 40)),
        max_size=40,
    ),
    st.integers(1, 5),
)
def test_random_operations_keep_the_books(ops: list[tuple[str, int]], page_size: int) -> None:
    """Any sequence of operations keeps ref counts, free list and reservations consistent."""
    bm = BlockManager(12, page_size)
    prefixes: list[PageTable] = []
    tables: list[PageTable] = []  # (shared or fresh) tables with a reservation
    for op, n in ops:
        if op == "allocate":
            try:
                prefixes.append(bm.allocate(n % 20 + 1))
            except MemoryError:
                assert bm.pages_for(n % 20 + 1) > bm.pages_available
        elif op == "share" and prefixes:
            prefix = prefixes[n % len(prefixes)]
            table, partial = bm.share(prefix)
            final = prefix.length + n
            if bm.reserve(table, final, copy_partial=partial is not None):
                tables.append(table)
            else:
                bm.release(table)
        elif op == "extend" and tables:
            table = tables[n % len(tables)]
            room = table.reserved * page_size + len(table.pages) * page_size - table.length
            bm.extend(table, min(room, n % 7))
        elif op == "release":
            pool = tables + prefixes
            if pool:
                index = n % len(pool)
                bm.release(pool[index])
                if index < len(tables):
                    del tables[index]
                else:
                    del prefixes[index - len(tables)]
        check_invariants(bm, prefixes + tables)
    for table in tables + prefixes:
        bm.release(table)
    assert bm.pages_in_use == 0 and bm.reserved == 0
    assert sorted(bm.free_pages) == list(range(12))
