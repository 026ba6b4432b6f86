"""Host bookkeeping of the paged KV cache's pages: the free list, reference counts, the prefix cache,
and the host's copy of every slot's page table.

The device side (the `PagedCache` pytree, page writes and paged attention) is `jaxgen.model.paged`;
this module says which pages a sequence holds, and when it takes and gives them back (`PagePolicy`).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxgen.inference.sampling import MAX_SPECULATIVE, SamplingError
from jaxgen.inference.sequence import Sequence


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
        self.idle_cached = 0  # cached pages nobody holds (evictable): kept counted, `available` walks nothing
        self.hits = 0  # prompt tokens served from the prefix cache
        self.lookups = 0  # prompt tokens looked up

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Pages that can be handed out now: free ones plus cached ones nobody uses."""
        return len(self.free) + self.idle_cached

    def in_use(self) -> int:
        return int((self.refs > 0).sum())

    @staticmethod
    def _chain(prev: bytes, tokens) -> bytes:
        return hashlib.blake2b(prev + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()

    def match_prefix(self, prompt: list[int], salt: bytes = b"") -> list[int]:
        """Cached pages holding the prompt's leading whole pages, leaving at least its last token to run.
        `salt` starts the hash chain: pages computed under another adapter (`Sequence.prefix_salt`) never match."""
        z = self.page_size
        pages, h = [], salt
        for i in range((len(prompt) - 1) // z):
            h = self._chain(h, prompt[i * z : (i + 1) * z])
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(
        self, prompt: list[int], total_tokens: int, reserve: int = 0, salt: bytes = b""
    ) -> tuple[list[int], int]:
        """Pages for a sequence of `total_tokens` tokens starting with `prompt`: shared prefix pages
        first (reference counted), then fresh ones. Returns (pages, tokens already cached), or raises
        PagesExhausted when they are not available now, `reserve` pages kept back for others (the
        caller waits and retries)."""
        shared = self.match_prefix(prompt, salt)
        needed = max(0, -(-total_tokens // self.page_size) - len(shared))
        reusable = sum(1 for p in shared if self.refs[p] == 0)  # cached, idle: not evictable for us
        if needed > self.available() - reusable - reserve:
            raise PagesExhausted(f"{needed} pages needed, {self.available() - reusable} available, {reserve} kept")
        for p in shared:
            self.idle_cached -= self.refs[p] == 0
            self.refs[p] += 1
            self.cached.move_to_end(self.hash_of[p])
        fresh = [self._take() for _ in range(needed)]
        for p in fresh:
            self.refs[p] = 1
        self.lookups += len(prompt)
        self.hits += len(shared) * self.page_size
        return shared + fresh, len(shared) * self.page_size

    def extend(self, n: int) -> list[int]:
        """`n` fresh pages for a sequence that grows, or PagesExhausted (none taken) when too few are free."""
        if n > len(self.free) and n > self.available():
            raise PagesExhausted(f"{n} pages needed, {self.available()} available")
        fresh = [self._take() for _ in range(n)]
        for p in fresh:
            self.refs[p] = 1
        return fresh

    def _take(self) -> int:
        if self.free:
            return self.free.popleft()
        for h, p in self.cached.items():  # least recently used first
            if self.refs[p] == 0:
                del self.cached[h]
                del self.hash_of[p]
                self.idle_cached -= 1
                return p
        raise PagesExhausted("no page left")  # allocate() checked availability first: not reached

    def register_prompt(self, prompt: list[int], pages: list[int], salt: bytes = b"") -> None:
        """After a prompt's prefill: its whole pages (all but one token must stay) become cache entries."""
        z, h = self.page_size, salt
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
            if self.refs[p] == 0:
                if p in self.hash_of:
                    self.idle_cached += 1
                else:
                    self.free.append(p)

    def forget(self, pages: list[int]) -> None:
        """Drops the cache entries of `pages` (their content was never written); held ones free on release."""
        for p in pages:
            h = self.hash_of.pop(p, None)
            if h is not None:
                del self.cached[h]
                if self.refs[p] == 0:
                    self.idle_cached -= 1
                    self.free.append(p)

    def clear_cache(self) -> None:
        """Drops every idle cached page (prefix caching off, or tests)."""
        for h, p in list(self.cached.items()):
            if self.refs[p] == 0:
                del self.cached[h]
                del self.hash_of[p]
                self.idle_cached -= 1
                self.free.append(p)


class PageTables:
    """The host's copy of every slot's page table row (B, M) and capacity in tokens (B,); `changed`
    until the engine pushes them to the device (`steps.set_tables`) before its next device step."""

    def __init__(self, slots: int, max_pages: int, page_size: int):
        self.page_size = page_size
        self.rows = np.zeros((slots, max_pages), np.int32)
        self.capacity = np.zeros(slots, np.int32)
        self.changed = True

    def assign(self, slot: int, pages: list[int]) -> None:
        """Slot `slot` holds `pages`, in position order (none: the slot is free)."""
        self.rows[slot] = 0
        self.rows[slot, : len(pages)] = pages
        self.capacity[slot] = len(pages) * self.page_size
        self.changed = True

    def take_changes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of the tables when they changed since the last call, else None."""
        if not self.changed:
            return None
        self.changed = False
        return self.rows.copy(), self.capacity.copy()


class PagePolicy:
    """When a sequence takes pages and gives them back, as vLLM does, and which pages each holds (the
    policy owns the lists: `pages_of`). A sequence takes pages for its prompt and one decode chunk when
    its prefill starts (keeping back those the running sequences need for their next chunk), then grows
    page by page as it decodes (`extend`, before each decode chunk: room for `chunk_steps` more tokens,
    bounded by max_new_tokens and the context). Which sequence gives way when the pool runs dry is the
    scheduler's decision (`jaxgen.inference.scheduler`).
    """

    def __init__(self, num_pages: int, page_size: int, slots: int, context: int, chunk_steps: int, prefix: bool,
                 ahead: int = 1):  # fmt: skip
        # ahead: decode chunks a sequence may run before the host hears of them, this one included (2 when the
        # engine overlaps a chunk with the last one's results: the host's token counts lag one chunk)
        self.page_size, self.slots, self.context, self.chunk_steps, self.prefix, self.ahead = (
            page_size, slots, context, chunk_steps, prefix, ahead
        )  # fmt: skip
        # pages one sequence may hold at most: bounded by the pool too, as the context may be 10**9 tokens
        self.max_pages = min(-(-context // page_size), num_pages)
        self.pool = PagePool(num_pages, page_size)
        self.tables = PageTables(slots, self.max_pages, page_size)
        self.held: dict[Sequence, list[int]] = {}  # each sequence's pages, in position order

    def reset(self) -> None:
        """A fresh pool and tables, nothing held (the engine rebuilt its device state)."""
        self.pool = PagePool(self.pool.num_pages, self.page_size)
        self.tables = PageTables(self.slots, self.max_pages, self.page_size)
        self.held.clear()  # cleared, not replaced: Requests read it (`Sequence.pages`)

    def pages_of(self, r: Sequence) -> list[int]:
        return self.held.get(r, [])

    def holds(self, r: Sequence) -> bool:
        return bool(self.held.get(r))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def check(self, prompt_len: int, max_new: int) -> None:
        """PageError for a sequence that could not fit even in the whole pool, alone."""
        pages = self.pages_for(min(prompt_len + max_new, self.context))
        if pages > self.pool.usable:
            raise PageError(
                f"the request needs {pages} pages of {self.page_size} tokens (prompt {prompt_len} + "
                f"max_new_tokens {max_new}); the page pool holds {self.pool.usable} in all "
                "(raise serve.kv_memory_gb or lower max_new_tokens)"
            )

    def short(self, r: Sequence) -> int:
        """Pages a sequence lacks for its next decode chunk (and the one in flight: `ahead`)."""
        position = len(r.prompt) + len(r.tokens)  # of its next token, as far as the host knows
        need = min(position + self.ahead * self.chunk_steps + spec_margin(r, self.ahead), r.limit(self.context))
        return max(0, self.pages_for(need) - len(self.pages_of(r)))

    def take_for_prefill(self, r: Sequence, reserve: int) -> tuple[int, int] | None:
        """Pages for a sequence's prefill and first decode chunk (shared prefix pages first) in slot
        `r.slot`, `reserve` pages kept back (what the running sequences lack for their next chunk: `short`);
        returns (tokens looked up in the prefix cache, tokens found), or None when too few pages are free."""
        # a prompt being scored runs whole: cached pages would skip the positions it asks about
        seq = r.sequence if self.prefix and not r.wants_prompt_scores else []
        need = min(len(r.sequence) + self.chunk_steps + spec_margin(r), r.limit(self.context))
        try:
            pages, cached = self.pool.allocate(seq, need, reserve, r.prefix_salt)
        except PagesExhausted:
            return None
        self.held[r] = pages
        self.tables.assign(r.slot, pages)
        return len(seq), cached

    def extend(self, r: Sequence) -> bool:
        """Room for a running sequence's next decode chunk; False (nothing taken) when the pool is dry."""
        try:
            self.held[r] = self.pages_of(r) + self.pool.extend(self.short(r))
        except PagesExhausted:
            return False
        self.tables.assign(r.slot, self.held[r])
        return True

    def register(self, r: Sequence) -> None:
        """A sequence whose prefill completes in the step being planned: its whole prompt pages become
        prefix-cache entries now, so a later chunk of the same step may share them (chunks run in order)."""
        self.pool.register_prompt(r.sequence, self.held[r], r.prefix_salt)

    def forget(self, r: Sequence) -> None:
        """Drops the prefix-cache entries of a sequence's pages (a prefill that did not run)."""
        self.pool.forget(self.pages_of(r))

    def release(self, r: Sequence, slot: int) -> None:
        """A sequence gives back its pages; its slot's table row is cleared."""
        if slot >= 0:
            self.tables.assign(slot, [])
        pages = self.held.pop(r, None)
        if pages:
            self.pool.release(pages)


def spec_margin(r: Sequence, chunks: int = 1) -> int:
    """Positions a speculating sequence may write past `chunk_steps` in each of `chunks` decode chunks: a
    chunk's last step may start up to MAX_SPECULATIVE + 1 tokens later (`steps.chunk_columns`), and the
    last writes its drafts' keys up to MAX_SPECULATIVE further."""
    return chunks * (MAX_SPECULATIVE + 1) + MAX_SPECULATIVE if r.sampling.num_speculative_tokens else 0
