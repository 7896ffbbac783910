"""A sorted collection of unique keys, for the schedulers: a list of short sorted lists.

Keys live in chunks of at most ``2 * load`` keys, each sorted, every key of a
chunk below every key of the next; ``_maxes`` holds each chunk's last key. An
insertion bisects ``_maxes`` and then one chunk, a removal likewise, so both
touch O(log n) keys and move at most one chunk's worth of pointers. Short
chunks keep that move cheap when the queue is long: with the default load
the cost of a push and a pop barely changes between 100 and 100,000 keys.
The rank of a key (how many keys sort before it) sums the lengths of the
chunks before its own through a Fenwick tree, rebuilt only after a chunk is
split or dropped.

The same idea as ``sortedcontainers.SortedList``, cut down to what the
schedulers use, with short chunks, and typed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar, final


class _Comparable(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Comparable)

#: Chunks split when they reach twice this many keys.
LOAD = 128


@final
class SortedKeys(Generic[K]):
    """Unique keys in ascending order; add, remove, first, last and rank in O(log n)."""

    __slots__ = ("_chunks", "_len", "_load", "_maxes", "_tree")

    def __init__(self, *, load: int = LOAD) -> None:
        self._load = load
        self._chunks: list[list[K]] = []
        self._maxes: list[K] = []
        self._len = 0
        # Fenwick tree over the chunks' lengths; None until a rank is asked for.
        self._tree: list[int] | None = None

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
            self._tree = None
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
            self._tree = None
        elif self._tree is not None:
            self._grow(pos, 1)

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

    def rank(self, key: K) -> int:
        """How many held keys sort before *key*."""
        maxes = self._maxes
        pos = bisect_left(maxes, key)
        if pos == len(maxes):
            return self._len
        tree = self._tree
        if tree is None:
            tree = self._tree = self._build_tree()
        before = 0
        i = pos  # the sum of the first pos chunk lengths, Fenwick-style
        while i > 0:
            before += tree[i]
            i -= i & -i
        return before + bisect_left(self._chunks[pos], key)

    def _delete(self, pos: int, index: int) -> None:
        chunk = self._chunks[pos]
        del chunk[index]
        self._len -= 1
        if not chunk:
            del self._chunks[pos]
            del self._maxes[pos]
            self._tree = None
            return
        if index == len(chunk):
            self._maxes[pos] = chunk[-1]
        if self._tree is not None:
            self._grow(pos, -1)

    def _grow(self, pos: int, by: int) -> None:
        tree = self._tree
        assert tree is not None
        i = pos + 1
        while i < len(tree):
            tree[i] += by
            i += i & -i

    def _build_tree(self) -> list[int]:
        tree = [0] + [len(chunk) for chunk in self._chunks]
        for i in range(1, len(tree)):
            parent = i + (i & -i)
            if parent < len(tree):
                tree[parent] += tree[i]
        return tree
