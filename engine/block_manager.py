"""Paged KV-cache bookkeeping: which page of the pool holds which positions of which sequence.

The pool (`KVPool`) is a fixed array of slots cut into pages of `page_size` positions. A sequence
owns a page table; position p lives in slot `table[p // page_size] * page_size + p % page_size`.
Pages are reference-counted so that every request speaking with one voice points at that voice's
prompt pages instead of prefilling it again. Shared pages are read-only: a voice prompt whose last
page is partly filled is copied into a private page before a request appends to it.

Admission reserves a clause's worst-case page count up front (`reserve`), while pages are only
taken from the free list as positions are written (`extend`), so a running clause can never find
the pool empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PageTable:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # positions written
    reserved: int = 0  # pages promised by `reserve` and not yet taken


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError("the KV pool needs at least one page of at least one slot")
        self.page_size = page_size
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.reserved = 0
        self._page_offsets = torch.arange(page_size)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def pages_available(self) -> int:
        """Pages neither in use nor promised to an admitted clause."""
        return len(self.free_pages) - self.reserved

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def slots(self, table: PageTable, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = table.length if end is None else end
        if not 0 <= start <= end <= len(table.pages) * self.page_size:
            raise IndexError(f"positions {start}..{end} outside a table of {table.length}")
        # Every slot of the table's pages, then the range: half the operators of indexing by
        # position (an AR step asks for every row's, 64 rows a step at c=64).
        pages = torch.tensor(table.pages, dtype=torch.long)
        return (pages[:, None] * self.page_size + self._page_offsets).view(-1)[start:end]

    def _take(self) -> int:
        page = self.free_pages.pop()
        self.ref_counts[page] = 1
        return page

    def allocate(self, positions: int) -> PageTable:
        """A fresh table holding `positions` positions (a voice prompt)."""
        needed = self.pages_for(positions)
        if needed > self.pages_available:
            raise MemoryError(f"{needed} KV pages needed, {self.pages_available} available")
        return PageTable([self._take() for _ in range(needed)], positions)

    def share(self, prefix: PageTable) -> tuple[PageTable, int | None]:
        """A table starting with `prefix`'s positions, its full pages shared.

        Returns the table and, when the prefix ends inside a page, that page: the caller copies
        its filled slots into the table's last page, which is private. Needs a reservation of one
        page for that copy (`reserve`).
        """
        full, partial = divmod(prefix.length, self.page_size)
        pages = prefix.pages[:full]
        for page in pages:
            self.ref_counts[page] += 1
        table = PageTable(list(pages), prefix.length)
        if not partial:
            return table, None
        return table, prefix.pages[full]

    def reserve(self, table: PageTable, final_length: int, copy_partial: bool = False) -> bool:
        """Promise the pages `table` needs to reach `final_length`, past those it holds or has
        been promised; False if they are not free."""
        needed = max(self.pages_for(final_length) - len(table.pages) - table.reserved, 0)
        if needed > self.pages_available:
            return False
        table.reserved += needed
        self.reserved += needed
        if copy_partial:
            # The private copy of a shared partial page is the first reserved page.
            table.pages.append(self._use_reservation(table))
        return True

    def _use_reservation(self, table: PageTable) -> int:
        table.reserved -= 1
        self.reserved -= 1
        return self._take()

    def extend(self, table: PageTable, count: int) -> None:
        """Grow `table` by `count` positions, taking reserved pages as needed."""
        table.length += count
        while len(table.pages) < self.pages_for(table.length):
            if table.reserved <= 0:
                raise RuntimeError("sequence outgrew its KV reservation")
            table.pages.append(self._use_reservation(table))

    def truncate(self, table: PageTable, length: int) -> None:
        """Forget `table`'s positions past `length`: its pages stay, to be written again."""
        table.length = min(table.length, length)

    def release(self, table: PageTable) -> None:
        for page in table.pages:
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)
        self.reserved -= table.reserved
        table.pages, table.length, table.reserved = [], 0, 0
