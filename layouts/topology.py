"""Parallel topology of one engine and one rank's coordinates in it.

Model of the ranks (the same on producer and consumer):

* ``pp_size`` pipeline stages; stage ``s`` holds a contiguous range of layers
  (see :meth:`KVCacheSpec.stage_layers`).
* ``tp_size`` tensor-parallel ranks per stage. Decode context parallelism
  (DCP) carves the TP group: ``tp_size % dcp_size == 0``, ``dcp_rank =
  tp_rank % dcp_size`` and ``head_group = tp_rank // dcp_size``. The
  ``dcp_size`` ranks of one head group hold the same KV heads and interleaved
  token shards (token ``t`` of a block lives on DCP rank ``t % dcp_size``).
* ``pcp_size`` prefill context-parallel ranks, an independent dimension.

A topology without ranks set describes the whole engine; :meth:`ranks` lists
every rank's coordinates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.limits import MAX_PARALLEL_SIZE, MAX_WORLD_SIZE, check_at_most

_SIZE_FIELDS = ("tp", "pp", "dcp", "pcp")


@dataclass(frozen=True, order=True)
class ParallelTopology:
    """Sizes of every parallel dimension plus this rank's coordinates."""

    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    pcp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dcp_size", "pcp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(name, f"expected an integer >= 1, got {value!r}")
            check_at_most(name, value, MAX_PARALLEL_SIZE)
        check_at_most("tp_size", self.tp_size * self.pp_size * self.pcp_size, MAX_WORLD_SIZE,
                      "ranks (tp_size * pp_size * pcp_size)")
        for name, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size),
                           ("pcp_rank", self.pcp_size)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
                raise LayoutError(name, f"expected an integer in [0, {size}), got {value!r}")
        if self.tp_size % self.dcp_size != 0:
            raise LayoutError(
                "dcp_size",
                f"DCP groups carve the TP group, so tp_size ({self.tp_size}) must be a "
                f"multiple of dcp_size ({self.dcp_size})",
            )

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def head_group(self) -> int:
        """Index of the group of ranks that hold the same KV heads."""
        return self.tp_rank // self.dcp_size

    @property
    def num_head_groups(self) -> int:
        return self.tp_size // self.dcp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.pcp_size

    def with_rank(self, *, tp_rank: int = 0, pp_rank: int = 0,
                  pcp_rank: int = 0) -> ParallelTopology:
        return replace(self, tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank)

    def ranks(self) -> Iterator[ParallelTopology]:
        """Every rank of the engine, ordered by (pp_rank, pcp_rank, tp_rank)."""
        for pp_rank in range(self.pp_size):
            for pcp_rank in range(self.pcp_size):
                for tp_rank in range(self.tp_size):
                    yield self.with_rank(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank)

    def sizes(self) -> ParallelTopology:
        """The same sizes with every rank set to 0 (the engine-wide description)."""
        return self.with_rank()

    def describe(self) -> str:
        return f"tp={self.tp_size},pp={self.pp_size},dcp={self.dcp_size},pcp={self.pcp_size}"

    def to_dict(self) -> dict[str, int]:
        return {
            "tp_size": self.tp_size, "pp_size": self.pp_size, "dcp_size": self.dcp_size,
            "pcp_size": self.pcp_size, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
            "pcp_rank": self.pcp_rank,
        }

    @classmethod
    def from_dict(cls, data: object, field: str = "topology") -> ParallelTopology:
        if not isinstance(data, dict):
            raise LayoutError(field, f"expected a mapping, got {type(data).__name__}")
        known = {"tp_size", "pp_size", "dcp_size", "pcp_size", "tp_rank", "pp_rank", "pcp_rank"}
        unknown = set(data) - known
        if unknown:
            raise LayoutError(f"{field}.{sorted(unknown)[0]}",
                              f"unknown field; expected one of {sorted(known)}")
        try:
            return cls(**data)
        except LayoutError as exc:
            raise LayoutError(f"{field}.{exc.field}", exc.reason) from None

    @classmethod
    def parse(cls, text: str, field: str = "topology") -> ParallelTopology:
        """Parse ``"tp=4,pp=2,dcp=2"`` (sizes only; missing ones default to 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _SIZE_FIELDS:
                raise LayoutError(field, f"expected comma-separated tp=N,pp=N,dcp=N,pcp=N, "
                                         f"got {part!r}")
            if key + "_size" in sizes:
                raise LayoutError(f"{field}.{key}", "given twice")
            try:
                sizes[key + "_size"] = int(value)
            except ValueError:
                raise LayoutError(f"{field}.{key}",
                                  f"expected an integer, got {value!r}") from None
        try:
            return cls(**sizes)
        except LayoutError as exc:
            raise LayoutError(f"{field}.{exc.field}", exc.reason) from None
