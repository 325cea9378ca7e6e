"""Page allocator for the paged KV cache: reference counts and prefix caching.

A page holds `page_size` consecutive token positions of one sequence. A full page whose
tokens are known gets a key chained from the previous page's key, so two sequences that
share a prefix share its pages. Freed pages keep their key until they are reused, which is
what makes a later request with the same prefix skip its computation.
"""

from __future__ import annotations

from collections import OrderedDict

NULL_PAGE = 0  # never handed out: padding in page tables points here


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_key: list[int | None] = [None] * num_pages
        self.page_content: list[tuple | None] = [None] * num_pages  # (parent key, tokens): guards against hash collisions
        self.cached: dict[int, int] = {}  # key -> page holding those tokens
        # Free pages, least recently freed first: reuse evicts the oldest cached prefixes.
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self.prefix_hits = 0  # pages reused from the prefix cache, over the pool's life

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_pages):
            raise RuntimeError(f"KV cache out of pages: asked for {n}, {len(self.free_pages)} free")
        pages = []
        for _ in range(n):
            page, _ = self.free_pages.popitem(last=False)
            self._forget(page)
            self.ref_count[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in reversed(pages):  # a sequence's tail is evicted before its head
            self.ref_count[page] -= 1
            assert self.ref_count[page] >= 0, f"page {page} freed twice"
            if self.ref_count[page] == 0:
                self.free_pages[page] = None

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """Pages already holding the first full pages of `token_ids` (at most `max_tokens`
        tokens) and their keys; each returned page gains a reference."""
        pages: list[int] = []
        keys: list[int] = []
        if not self.enable_prefix_caching:
            return pages, keys
        key = 0
        for start in range(0, max_tokens - self.page_size + 1, self.page_size):
            tokens = tuple(token_ids[start:start + self.page_size])
            key = hash((key, tokens))
            page = self.cached.get(key)
            if page is None or self.page_content[page] != (keys[-1] if keys else 0, tokens):
                break
            if self.ref_count[page] == 0:
                del self.free_pages[page]
            self.ref_count[page] += 1
            pages.append(page)
            keys.append(key)
        self.prefix_hits += len(pages)
        return pages, keys

    def register(self, pages: list[int], keys: list[int], token_ids: list[int], num_known: int) -> None:
        """Extend a sequence's key chain `keys` (one key per keyed page, in place) over the
        pages that are now full of known tokens, and offer them to later requests."""
        if not self.enable_prefix_caching:
            return
        full = min(num_known // self.page_size, len(pages))
        for i in range(len(keys), full):
            parent = keys[-1] if keys else 0
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            key = hash((parent, tokens))
            keys.append(key)
            page = pages[i]
            if key not in self.cached and self.page_key[page] is None:
                self.cached[key] = page
                self.page_key[page] = key
                self.page_content[page] = (parent, tokens)

    def _forget(self, page: int) -> None:
        key = self.page_key[page]
        if key is not None:
            del self.cached[key]
            self.page_key[page] = None
            self.page_content[page] = None
