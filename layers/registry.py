"""Name -> object tables: backbones, attention variants, checkpoint converters.

One instance per kind of thing; entries go in with :meth:`Registry.register`
(usable as a class or function decorator) and come out with :meth:`Registry.get`,
whose error lists the valid names::

    ATTENTION = Registry("attention")

    @ATTENTION.register("mha")
    class MultiHeadAttention(nn.Module): ...

    ATTENTION.get("MHA")  # names are case-insensitive
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")
E = TypeVar("E")


class Registry(Generic[E]):
    """Entries by lower-case name. Registering a name again with another object is an error
    (two classes claiming one name); registering the same object again is a no-op."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, E] = {}

    def add(self, name: str, entry: E) -> E:
        key = name.lower()
        if key in self._entries and self._entries[key] is not entry:
            raise ValueError(f"{self.kind} name {name!r} is already registered to {self._entries[key]}")
        self._entries[key] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`: ``@registry.register("name")`` above a class or function."""

        def decorator(entry: T) -> T:
            self.add(name, entry)  # type: ignore[arg-type]
            return entry

        return decorator

    def get(self, name: str) -> E:
        try:
            return self._entries[name.lower()]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, E]]:
        """(name, entry) pairs in the order they were registered."""
        return iter(list(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
