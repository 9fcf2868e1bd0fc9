"""Small helpers: an LRU cache, a binary search and a tiny tokenizer."""

import re
from collections import OrderedDict


class LRUCache:
    """A mapping that keeps at most ``capacity`` items, dropping the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str, default: object = None) -> object:
        """Return the value stored under ``key`` and mark it as recently used."""
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``, evicting the oldest item when the cache is full."""
        if key in self._items:
            self._items.move_to_end(key)
        self._items[key] = value
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)


def binary_search(items: list[int], target: int) -> int:
    """Return the index of ``target`` in the sorted list ``items``, or -1 if it is absent."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


TOKEN_PATTERN = re.compile(r"\d+(?:\.\d+)?|[A-Za-z_]\w*|==|!=|<=|>=|\S")


def tokenize(source: str) -> list[tuple[str, str]]:
    """Split ``source`` into ``(kind, text)`` pairs: numbers, names and symbols.

    >>> tokenize("x = 3.5 + y")
    [('name', 'x'), ('symbol', '='), ('number', '3.5'), ('symbol', '+'), ('name', 'y')]
    """
    tokens = []
    for match in TOKEN_PATTERN.finditer(source):
        text = match.group()
        if text[0].isdigit():
            kind = "number"
        elif text[0].isalpha() or text[0] == "_":
            kind = "name"
        else:
            kind = "symbol"
        tokens.append((kind, text))
    return tokens

