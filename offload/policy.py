"""Eviction policies of the primary tier: LRU and ARC (pure, no I/O, no threads).

A policy only orders resident keys; whether a key *may* leave is the tier's
business (``can_evict``: never a pinned or in-flight slot). ``evict`` walks from
the coldest key and skips the ones ``can_evict`` refuses, so a pinned block is
never a victim however cold it is; it returns None when nothing may leave.

Call order for a new block: ``admit(key)`` (ARC adapts its target on a ghost
hit), ``evict(...)`` as often as room is needed, then ``insert(key)``.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable

from kvbridge.offload.types import OffloadError, OffloadKey

CanEvict = Callable[[OffloadKey], bool]


class EvictionPolicy(abc.ABC):
    name: str = ""

    def admit(self, key: OffloadKey) -> None:  # noqa: B027 (optional hook)
        """A block for ``key`` is about to be inserted (before any eviction)."""

    @abc.abstractmethod
    def insert(self, key: OffloadKey) -> None:
        """``key`` became resident."""

    @abc.abstractmethod
    def access(self, key: OffloadKey) -> None:
        """``key`` was used (hit, touch)."""

    @abc.abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """``key`` left for a reason of its own (failed write): no history kept."""

    @abc.abstractmethod
    def evict(self, can_evict: CanEvict) -> OffloadKey | None:
        """Remove and return the coldest key ``can_evict`` accepts, or None."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...


def _pop_first(order: OrderedDict[OffloadKey, None], can_evict: CanEvict) -> OffloadKey | None:
    for key in order:
        if can_evict(key):
            del order[key]
            return key
    return None


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: OffloadKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def evict(self, can_evict: CanEvict) -> OffloadKey | None:
        return _pop_first(self._order, can_evict)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache (Megiddo & Modha).

    T1 holds keys seen once, T2 keys seen at least twice; B1/B2 are ghost lists
    (keys only) of what T1/T2 evicted. A re-admitted B1 ghost means T1 was too
    small, so the target size ``p`` of T1 grows; a B2 ghost shrinks it.
    Invariants: T1..B2 are disjoint; |T1|+|B1| <= c and the four lists hold at
    most 2c keys (c = capacity in blocks); 0 <= p <= c.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise OffloadError("capacity", f"expected a positive number of blocks, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._incoming_from_b2 = False

    def admit(self, key: OffloadKey) -> None:
        self._incoming_from_b2 = False
        if key in self.b1:
            delta = max(1.0, len(self.b2) / len(self.b1))
            self.p = min(float(self.capacity), self.p + delta)
        elif key in self.b2:
            delta = max(1.0, len(self.b1) / len(self.b2))
            self.p = max(0.0, self.p - delta)
            self._incoming_from_b2 = True

    def insert(self, key: OffloadKey) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._incoming_from_b2 = False
        self._trim_ghosts()

    def access(self, key: OffloadKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, can_evict: CanEvict) -> OffloadKey | None:
        t1_len = len(self.t1)
        prefer_t1 = t1_len > 0 and (t1_len > self.p or (self._incoming_from_b2 and t1_len >= self.p))
        order = ((self.t1, self.b1), (self.t2, self.b2))
        if not prefer_t1:
            order = order[::-1]
        for resident, ghosts in order:
            key = _pop_first(resident, can_evict)
            if key is not None:
                ghosts[key] = None
                self._trim_ghosts()
                return key
        return None

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)
        while self.b1 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b1.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Policy by name ("lru" or "arc")."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise OffloadError("policy", f"expected 'lru' or 'arc', got {name!r}")
