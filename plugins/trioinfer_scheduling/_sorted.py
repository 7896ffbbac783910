"""Sorted collections for the schedulers, each a list of short sorted chunks.

`SortedKeys` holds unique comparable keys (the priority scheduler's levels and
heads); `TimeQueue` holds items by a float key, then by a ticket number (the
deadline scheduler's requests, by deadline, then in the order they were
made). In both, keys live in chunks of at most ``2 * load`` keys, each
sorted, every key of a chunk below every key of the next, and each chunk's
last key is kept apart. An insertion
bisects those last keys and then one chunk, a removal likewise, so both touch
O(log n) keys and move at most one chunk's worth of pointers. Short chunks
keep that move cheap when the queue is long: with the default load the number
of keys touched barely changes between 100 and 100,000 keys. `TimeQueue`
counts the items up to a key (for the deadline scheduler's admission
estimate) by summing the lengths of the chunks before the key's own through a
Fenwick tree, rebuilt only after a chunk is split or dropped.

The same idea as ``sortedcontainers.SortedList``, cut down to what the
schedulers use, with short chunks, and typed. It is kept over ``SortedList``
(which trio installs anyway) because it measured clearly faster on the
schedulers' hot operations (``benchmarks/bench_sorted.py``, both side by side;
figures in the docs' benchmarks page): with 100,000 requests queued under
random deadlines, the deadline scheduler's push and pop cost 2.2-2.5 times as
much on ``SortedList`` (its tuples are a cache miss per comparison, where
`TimeQueue` bisects flat doubles), breaking the schedulers' target of at most
twice the cost at 100 queued; the priority scheduler costs 1.2-1.35 times as
much at any length.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, final


class _Comparable(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Comparable)
T = TypeVar("T")

#: Chunks split when they reach twice this many keys.
LOAD = 128


@final
class SortedKeys(Generic[K]):
    """Unique keys in ascending order; add, remove, first and last in O(log n)."""

    __slots__ = ("_chunks", "_len", "_load", "_maxes")

    def __init__(self, *, load: int = LOAD) -> None:
        self._load = load
        self._chunks: list[list[K]] = []
        self._maxes: list[K] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        for chunk in self._chunks:
            yield from chunk

    def add(self, key: K) -> None:
        """Insert *key*, which must not be held already."""
        maxes = self._maxes
        if not maxes:
            self._chunks.append([key])
            maxes.append(key)
            self._len = 1
            return
        pos = bisect_left(maxes, key)
        if pos == len(maxes):
            pos -= 1
            chunk = self._chunks[pos]
            chunk.append(key)
            maxes[pos] = key
        else:
            chunk = self._chunks[pos]
            insort(chunk, key)
        self._len += 1
        if len(chunk) >= 2 * self._load:
            half = chunk[self._load :]
            del chunk[self._load :]
            self._chunks.insert(pos + 1, half)
            maxes[pos] = chunk[-1]
            maxes.insert(pos + 1, half[-1])

    def remove(self, key: K) -> None:
        """Remove *key*; ``ValueError`` if it is not held."""
        maxes = self._maxes
        pos = bisect_left(maxes, key)
        if pos == len(maxes):
            raise ValueError(f"{key!r} is not held")
        chunk = self._chunks[pos]
        index = bisect_left(chunk, key)
        if chunk[index] != key:
            raise ValueError(f"{key!r} is not held")
        self._delete(pos, index)

    def first(self) -> K:
        """The smallest key; ``IndexError`` if empty."""
        return self._chunks[0][0]

    def last(self) -> K:
        """The largest key; ``IndexError`` if empty."""
        return self._maxes[-1]

    def second(self) -> K:
        """The second smallest key; ``IndexError`` if fewer than two are held."""
        chunk = self._chunks[0]
        return chunk[1] if len(chunk) > 1 else self._chunks[1][0]

    def pop_first(self) -> K:
        """Remove and return the smallest key; ``IndexError`` if empty."""
        key = self._chunks[0][0]
        self._delete(0, 0)
        return key

    def _delete(self, pos: int, index: int) -> None:
        chunk = self._chunks[pos]
        del chunk[index]
        self._len -= 1
        if not chunk:
            del self._chunks[pos]
            del self._maxes[pos]
            return
        if index == len(chunk):
            self._maxes[pos] = chunk[-1]


def _fenwick(lengths: list[int]) -> list[int]:
    """A Fenwick tree (1-based) over *lengths*: prefix sums in O(log n)."""
    tree = [0, *lengths]
    for i in range(1, len(tree)):
        parent = i + (i & -i)
        if parent < len(tree):
            tree[parent] += tree[i]
    return tree


def _prefix(tree: list[int], pos: int) -> int:
    """The sum of the first *pos* entries of the Fenwick *tree*."""
    total = 0
    while pos > 0:
        total += tree[pos]
        pos -= pos & -pos
    return total


def _grow(tree: list[int], pos: int, by: int) -> None:
    """Add *by* to entry *pos* (0-based) of the Fenwick *tree*."""
    i = pos + 1
    while i < len(tree):
        tree[i] += by
        i += i & -i


@final
class TimeQueue(Generic[T]):
    """Items ordered by a float key (a time), then by a ticket: an integer per item.

    The layout of `SortedKeys` (short sorted chunks, the chunks' last keys
    bisected first), with a Fenwick tree for `count_until`, but a chunk's keys live in a
    flat ``array('d')`` beside a list of its items, instead of in tuples: a
    bisection reads consecutive doubles rather than following a pointer to a
    tuple and another to its float for every comparison. With 100,000 items
    queued those pointers lead all over the heap and each one is a cache
    miss; that, not the number of comparisons, made a push cost several
    times more than with 100 queued.

    Items with equal keys are kept in the order of their tickets, which
    *ticket* reads from each item (the deadline scheduler's: the request's
    `sequence`, so first come first served). It is read only among equal
    keys, so that removing one of many with the same key (callers that share
    one ``fail_after`` scope share a deadline) is a bisection too, not a
    scan; items with keys of their own are never touched after they are
    added. Tickets must be unique and never change.
    """

    __slots__ = ("_items", "_keys", "_len", "_load", "_max_keys", "_ticket", "_tree")

    def __init__(self, ticket: Callable[[T], int], *, load: int = LOAD) -> None:
        self._ticket = ticket
        self._load = load
        # Chunk i: keys and items in (key, ticket) order.
        self._keys: list[array[float]] = []
        self._items: list[list[T]] = []
        self._max_keys: array[float] = array("d")  # each chunk's last key
        self._len = 0
        # Fenwick tree over the chunks' lengths; None until a count is asked for.
        self._tree: list[int] | None = None

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        for items in self._items:
            yield from items

    def add(self, key: float, item: T) -> bool:
        """Queue *item* by *key* and then its ticket; ``False`` (and nothing done) if held.

        Whether it is held costs nothing more than finding its place: the same
        item has the same key and ticket, so it sits where it would go.
        """
        max_keys = self._max_keys
        pos = bisect_right(max_keys, key)
        if pos and max_keys[pos - 1] == key:
            # Chunks end on this key: the item goes into the first whose last ticket is later.
            start = bisect_left(max_keys, key, 0, pos)
            pos = self._chunk_of(self._ticket(item), start, pos)
        if pos == len(max_keys):
            if not max_keys:
                self._keys.append(array("d", (key,)))
                self._items.append([item])
                max_keys.append(key)
                self._len = 1
                self._tree = None
                return True
            # After every held item: any that share the key have earlier tickets.
            pos -= 1
            keys, items = self._keys[pos], self._items[pos]
            keys.append(key)
            items.append(item)
            max_keys[pos] = key
        else:
            keys, items = self._keys[pos], self._items[pos]
            index = bisect_right(keys, key)
            if index and keys[index - 1] == key:
                index = self._index_of(keys, items, key, self._ticket(item), index)
                if index < len(items) and items[index] is item:
                    return False
            keys.insert(index, key)
            items.insert(index, item)
        self._len += 1  # only once held: a ticket function that raised leaves no trace
        if len(keys) >= 2 * self._load:
            load = self._load
            self._keys.insert(pos + 1, keys[load:])
            self._items.insert(pos + 1, items[load:])
            del keys[load:], items[load:]
            max_keys.insert(pos, keys[-1])
            self._tree = None
        elif self._tree is not None:
            _grow(self._tree, pos, 1)
        return True

    def remove(self, key: float, item: T) -> bool:
        """Remove *item*, added with *key*; return whether it was held (with that key)."""
        found = self._find(key, item)
        if found is None:
            return False
        self._delete(*found)
        return True

    def holds(self, key: float, item: T) -> bool:
        """Whether *item* is held, added with *key*."""
        return self._find(key, item) is not None

    def _find(self, key: float, item: T) -> tuple[int, int] | None:
        # (chunk, index) of *item*, added with *key*; None if it is not held.
        max_keys = self._max_keys
        pos = bisect_left(max_keys, key)
        if pos == len(max_keys):
            return None
        ticket: int | None = None
        if max_keys[pos] == key:
            # Several chunks may end on this key: their last items' tickets ascend.
            ticket = self._ticket(item)
            pos = self._chunk_of(ticket, pos, bisect_right(max_keys, key, pos))
            if pos == len(max_keys):
                return None
        keys, items = self._keys[pos], self._items[pos]
        index = bisect_left(keys, key)
        end = bisect_right(keys, key, index)
        if end - index > 1:
            if ticket is None:
                ticket = self._ticket(item)
            index = bisect_left(items, ticket, index, end, key=self._ticket)
        if index == end or items[index] is not item:
            return None
        return pos, index

    def first(self) -> T:
        """The item with the smallest key (first ticket among equals); ``IndexError`` if empty."""
        return self._items[0][0]

    def pop_first(self) -> T:
        """Remove and return the item `first` names; ``IndexError`` if empty."""
        item = self._items[0][0]
        self._delete(0, 0)
        return item

    def count_until(self, key: float) -> int:
        """How many held items have a key of at most *key*: those an item added now follows."""
        max_keys = self._max_keys
        pos = bisect_right(max_keys, key)
        if pos == len(max_keys):
            return self._len
        tree = self._tree
        if tree is None:
            tree = self._tree = _fenwick([len(keys) for keys in self._keys])
        return _prefix(tree, pos) + bisect_right(self._keys[pos], key)

    def _chunk_of(self, ticket: int, start: int, end: int) -> int:
        # Among chunks start..end-1, which all end on one key, the first whose last
        # ticket is at least *ticket* (or *end*, when none is).
        tickets = self._ticket
        return bisect_left(self._items, ticket, start, end, key=lambda items: tickets(items[-1]))

    def _index_of(
        self, keys: array[float], items: list[T], key: float, ticket: int, end: int
    ) -> int:
        # Within a chunk, among the items keyed *key* before *end*, where *ticket* goes.
        start = bisect_left(keys, key, 0, end)
        return bisect_left(items, ticket, start, end, key=self._ticket)

    def _delete(self, pos: int, index: int) -> None:
        keys, items = self._keys[pos], self._items[pos]
        del keys[index], items[index]
        self._len -= 1
        if not keys:
            del self._keys[pos], self._items[pos], self._max_keys[pos]
            self._tree = None
            return
        if index == len(keys):
            self._max_keys[pos] = keys[-1]
        if self._tree is not None:
            _grow(self._tree, pos, -1)
