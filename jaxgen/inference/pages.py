"""Host bookkeeping of the paged KV cache's pages: the free list, reference counts, the prefix cache.

The device side (the `PagedCache` pytree, page writes and paged attention) is `jaxgen.model.paged`;
this module decides which pages a sequence gets.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxgen.inference.sampling import SamplingError


class PageError(SamplingError):
    """A request that can never fit in the page pool: a bad request, refused before it is queued."""


class PagesExhausted(RuntimeError):
    """Not enough free pages right now: the request waits for running ones to finish."""


class PagePool:
    """Host bookkeeping of the pages: free list, reference counts, and the prefix cache.

    A prefix-cache entry maps the hash of a prompt's first k whole pages (their token ids, chained) to
    the page holding the k-th of them. Cached pages whose reference count drops to zero stay cached
    (and their content valid) until memory is needed: then the least recently used is evicted.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved); got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.refs = np.zeros(num_pages, np.int32)
        self.free: collections.deque[int] = collections.deque(range(1, num_pages))
        self.cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # hash -> page, LRU order
        self.hash_of: dict[int, bytes] = {}
        self.hits = 0  # prompt tokens served from the prefix cache
        self.lookups = 0  # prompt tokens looked up

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Pages that can be handed out now: free ones plus cached ones nobody uses."""
        return len(self.free) + sum(1 for p in self.cached.values() if self.refs[p] == 0)

    def in_use(self) -> int:
        return int((self.refs > 0).sum())

    @staticmethod
    def _chain(prev: bytes, tokens) -> bytes:
        return hashlib.blake2b(prev + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()

    def match_prefix(self, prompt: list[int]) -> list[int]:
        """Cached pages holding the prompt's leading whole pages, leaving at least its last token to run."""
        z = self.page_size
        pages, h = [], b""
        for i in range((len(prompt) - 1) // z):
            h = self._chain(h, prompt[i * z : (i + 1) * z])
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(self, prompt: list[int], total_tokens: int) -> tuple[list[int], int]:
        """Pages for a sequence of `total_tokens` tokens starting with `prompt`: shared prefix pages
        first (reference counted), then fresh ones. Returns (pages, tokens already cached), or raises
        PagesExhausted when they are not available now (the caller waits and retries)."""
        shared = self.match_prefix(prompt)
        needed = max(0, -(-total_tokens // self.page_size) - len(shared))
        reusable = sum(1 for p in shared if self.refs[p] == 0)  # cached, idle: not evictable for us
        if needed > self.available() - reusable:
            raise PagesExhausted(f"{needed} pages needed, {self.available() - reusable} available")
        for p in shared:
            self.refs[p] += 1
            self.cached.move_to_end(self.hash_of[p])
        fresh = [self._take() for _ in range(needed)]
        for p in fresh:
            self.refs[p] = 1
        self.lookups += len(prompt)
        self.hits += len(shared) * self.page_size
        return shared + fresh, len(shared) * self.page_size

    def _take(self) -> int:
        if self.free:
            return self.free.popleft()
        for h, p in self.cached.items():  # least recently used first
            if self.refs[p] == 0:
                del self.cached[h]
                del self.hash_of[p]
                return p
        raise PagesExhausted("no page left")  # allocate() checked availability first: not reached

    def register_prompt(self, prompt: list[int], pages: list[int]) -> None:
        """After a prompt's prefill: its whole pages (all but one token must stay) become cache entries."""
        z, h = self.page_size, b""
        for i in range((len(prompt) - 1) // z):
            h = self._chain(h, prompt[i * z : (i + 1) * z])
            if h not in self.cached and pages[i] not in self.hash_of:
                self.cached[h] = pages[i]
                self.hash_of[pages[i]] = h
            elif h in self.cached:
                self.cached.move_to_end(h)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0 and p not in self.hash_of:
                self.free.append(p)

    def clear_cache(self) -> None:
        """Drops every idle cached page (prefix caching off, or tests)."""
        for h, p in list(self.cached.items()):
            if self.refs[p] == 0:
                del self.cached[h]
                del self.hash_of[p]
                self.free.append(p)
