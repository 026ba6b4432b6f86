"""The tables that live on the device: the automata of a batch (`layout`, `stack`) or of the engine's slots
(`GrammarPool`) in one (S, V) int32 table, each automaton's states at its own offset, state 0 free.

The decode loop carries each row's state: it masks the logits to the tokens the state allows and moves along
the table after the draw, on the device, so a constrained row never waits for the host and a free row (state
0 allows every token and stays put) sees its logits unchanged.
"""

from __future__ import annotations

import numpy as np

from jaxgen.inference.structured.automaton import Automaton


def layout(automata: list[Automaton | None]) -> tuple[tuple[Automaton, ...], np.ndarray]:
    """Where a batch's automata go in its table: the distinct ones in order of first use, and each row's
    start state (B,) int32 (0 for a free row; state 0 is the free row's, then each automaton's states
    follow those before it)."""
    distinct, offsets, starts, size = [], {}, [], 1
    for a in automata:
        if a is not None and id(a) not in offsets:
            offsets[id(a)] = size
            distinct.append(a)
            size += a.num_states
        starts.append(0 if a is None else offsets[id(a)])
    return tuple(distinct), np.asarray(starts, np.int32)


def stack(distinct: tuple[Automaton, ...], vocab_size: int) -> np.ndarray:
    """The table (S, V) int32 of `layout`'s distinct automata, rows padded to a power of two (a handful of
    shapes): row 0 allows every token and stays at 0, each automaton's states shifted past those before."""
    size = 1 + sum(a.num_states for a in distinct)
    table = np.full((1 << (size - 1).bit_length(), vocab_size), -1, np.int32)
    table[0] = 0
    offset = 1
    for a in distinct:
        block = table[offset : offset + a.num_states]
        np.add(a.next_state, offset, out=block, where=a.next_state >= 0)
        offset += a.num_states
    return table


AUTO_TABLE_BYTES, AUTO_MAX_STATES = 64 * 2**20, 4096  # serve.grammar_states=0


def table_rows(states: int, vocab_size: int) -> int:
    """The engine's table rows from the start for serve.grammar_states (`states`, rounded up to a power of
    two; 0: the most, a power of two, that AUTO_TABLE_BYTES of int32 rows hold, at most AUTO_MAX_STATES)."""
    if not states:
        fit = max(1, min(AUTO_MAX_STATES, AUTO_TABLE_BYTES // (4 * vocab_size)))
        return 1 << (fit.bit_length() - 1)
    return 1 << (states - 1).bit_length()


class GrammarPool:
    """The engine's table: the automata of the requests in its slots, each at its own range of states (state 0
    free). A range is shared by the slots that use the same constraint and reused once none does; the table
    grows to the next power of two when full (a new shape: the engine's steps compile once more), or at once
    to a size given to `reserve`. `rows`: its size from the start (`table_rows`), the device's copy made
    alike (`steps.init_state`): the unused rows are never reached."""

    def __init__(self, vocab_size: int, rows: int = 1):
        self.table = np.full((rows, vocab_size), -1, np.int32)
        self.table[0] = 0  # the free state: every token allowed, and it stays
        self.changed = False  # the table differs from the device's copy
        self._slots: dict[int, Automaton] = {}
        self._ranges: dict[int, list] = {}  # id(automaton) -> [offset, size, slots using it]

    def reserve(self, rows: int) -> None:
        """Grows the table to at least `rows` states now (a power of two): a server that knows its constraints'
        sizes compiles its steps for that table once, not once per growth."""
        if rows > self.table.shape[0]:
            self._grow(rows)

    def assign(self, slot: int, automaton: Automaton | None) -> int:
        """Slot `slot` now runs `automaton` (None: free); returns the offset of its states (0 when free)."""
        old = self._slots.pop(slot, None)
        if old is not None:
            entry = self._ranges[id(old)]
            entry[2] -= 1
            if entry[2] == 0:
                del self._ranges[id(old)]
        if automaton is None:
            return 0
        self._slots[slot] = automaton
        entry = self._ranges.get(id(automaton))
        if entry is None:
            offset = self._place(automaton.num_states)
            self.table[offset : offset + automaton.num_states] = np.where(
                automaton.next_state >= 0, automaton.next_state + offset, -1
            )
            entry = self._ranges[id(automaton)] = [offset, automaton.num_states, 0]
            self.changed = True
        entry[2] += 1
        return entry[0]

    def _place(self, n: int) -> int:
        """The first free range of `n` states, growing the table when there is none."""
        start = 1
        for offset, size, _ in sorted(self._ranges.values()):
            if offset - start >= n:
                return start
            start = max(start, offset + size)
        if start + n > self.table.shape[0]:
            self._grow(start + n)
        return start

    def _grow(self, rows: int) -> None:
        grown = np.full((1 << (rows - 1).bit_length(), self.table.shape[1]), -1, np.int32)
        grown[: self.table.shape[0]] = self.table
        self.table = grown
        self.changed = True
