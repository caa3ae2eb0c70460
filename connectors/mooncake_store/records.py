"""Digest records: what the Mooncake store connector puts next to a block so readers can check it.

Pure (numpy and :mod:`kvbridge.layouts.digests`, no I/O). One record per
(namespace, block), i.e. per rank's part of one block of one region, under
its own small key, put beside the block's layer objects (the same step)::

    <KeyNamespace.encode()>:D1:<64 hex digits of the chained block hash>

Why a companion key and not extra bytes in each object: a layer object is
``tensor[block_id]`` of one layer, put and got zero-copy straight from and
into the registered KV tensor; bytes appended to it could only be put from a
staging copy, and a get would write them past the block into its neighbour.
A companion object keeps every KV object byte-identical to what older
versions store (they ignore the ``D1`` key; a reader of this version finds no
record under an older version's blocks and serves them as *unverified*, if
its policy allows). The ``1`` in ``D1`` is :data:`RECORD_VERSION`: a later
format gets a new key, so a reader never parses a record it does not know.

Record layout, little-endian, ``32 + 8 * num_layers`` bytes::

    magic          4s   b"KVBD"
    record_version u16  RECORD_VERSION
    digest_version u16  kvbridge.layouts.digests.DIGEST_VERSION
    algorithm      u32  index + 1 in digests.ALGORITHMS: 1 = "xxh3-64" (KV in host
                        memory), 2 = "torch-mix64-v1" (KV in device memory, or asked for)
    num_layers     u32  layers of the region on this rank's stage
    block_bytes    u64  bytes of the block in each layer (one layer object)
    key_digest     u64  XXH3-64 of the record's own key (binds it to namespace and block)
    layer_digests  u64 x num_layers, in layer order (the block digest is their ``combine``)

The reader knows its own geometry (layers, bytes per layer), so it gets the
record into a slot of exactly :func:`record_bytes` (a bigger or smaller object
is a size mismatch, never a read past the slot) and checks every header field
before it trusts a digest. The algorithm is the writer's: a reader digests the
landed bytes with the algorithm each record names (:meth:`RecordTable.algorithms`),
when it can (XXH3-64 reads host memory; a rank whose KV is in device memory
takes ``torch-mix64-v1`` digests only), and serves a block whose record names
one it cannot compute as unverified.

Consistency: a record and its block's layer objects are separate keys, put in
one batch but not atomically, and a put keeps an existing key's value. If the
store evicts some of a block's objects and another writer stores them again
from KV that is not bitwise the same, the old record no longer vouches for the
new bytes: the reader reports a mismatch, the block is recomputed, and the
reader removes that block's keys so the next put stores a consistent set. A
false alarm costs a recompute, never wrong bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.layouts import KeyNamespace
from kvbridge.layouts.digests import (
    ALGORITHM,
    ALGORITHMS,
    DIGEST_VERSION,
    digest_bytes,
    digest_texts,
)

MAGIC = b"KVBD"
RECORD_VERSION = 1
def algorithm_id(algorithm: str) -> int:
    """The ``algorithm`` field of a record digested with ``algorithm``."""
    return ALGORITHMS.index(algorithm) + 1


def algorithm_of(field: int) -> str | None:
    """The algorithm a record's ``algorithm`` field names (None: none this version knows)."""
    return ALGORITHMS[field - 1] if 1 <= field <= len(ALGORITHMS) else None
HEADER_BYTES = 32


def digest_key_prefix(namespace: KeyNamespace) -> str:
    """Everything of a digest record's key before the block hash."""
    return f"{namespace.encode()}:D{RECORD_VERSION}:"


def record_dtype(num_layers: int) -> np.dtype:
    """The numpy structured dtype of one record (packed, little-endian)."""
    if num_layers < 1:
        raise ValueError(f"a digest record covers >= 1 layer, got {num_layers}")
    return np.dtype([("magic", "S4"), ("record_version", "<u2"), ("digest_version", "<u2"),
                     ("algorithm", "<u4"), ("num_layers", "<u4"), ("block_bytes", "<u8"),
                     ("key_digest", "<u8"), ("layer_digests", "<u8", (num_layers,))])


def record_bytes(num_layers: int) -> int:
    """Size of one record in bytes."""
    return HEADER_BYTES + 8 * num_layers


def key_digest(key: str) -> int:
    return digest_bytes(key.encode())


def digests_of_keys(keys: Sequence[str]) -> list[int]:
    """:func:`key_digest` of each key (one C call per key, no Python frame around it)."""
    return digest_texts(keys)


class RecordVerdict(enum.Enum):
    """Why a reader does not trust the record it got for one block."""

    MISMATCH = "mismatch"        # a well-formed record for this key; some layer differs
    INVALID = "invalid"          # not a record of this geometry: fail the block
    FOREIGN = "foreign"          # a well-formed record made for another key: fail the block


@dataclass(frozen=True)
class RecordCheck:
    verdict: RecordVerdict
    #: first differing layer (position in the region's layers), for MISMATCH
    layer_position: int = -1
    #: what was wrong, for INVALID (a field name and the values)
    reason: str = ""


class RecordTable:
    """One region's records on one rank, one slot per local block id, in a flat buffer.

    ``buffer`` is a ``uint8`` array of ``num_blocks * record_bytes(num_layers)``
    bytes (registered with the store client by the worker, so records are put
    and got zero-copy); every slot's constant header is written once, here.
    ``algorithm``: what this rank's digests are taken with (the header it writes).
    """

    def __init__(self, buffer: np.ndarray, num_layers: int, block_bytes: int,
                 num_blocks: int, algorithm: str = ALGORITHM) -> None:
        dtype = record_dtype(num_layers)
        if buffer.dtype != np.uint8 or buffer.nbytes != num_blocks * dtype.itemsize:
            raise ValueError(f"expected {num_blocks * dtype.itemsize} bytes of uint8, got "
                             f"{buffer.nbytes} of {buffer.dtype}")
        self.num_layers = num_layers
        self.block_bytes = block_bytes
        self.algorithm_id = algorithm_id(algorithm)
        self.record_bytes = dtype.itemsize
        self.base_ptr = int(buffer.ctypes.data)
        self.records = buffer.view(dtype)

    def reset_headers(self) -> None:
        """Write the header fields that are the same in every record of this table."""
        records = self.records
        records["magic"] = MAGIC
        records["record_version"] = RECORD_VERSION
        records["digest_version"] = DIGEST_VERSION
        records["algorithm"] = self.algorithm_id
        records["num_layers"] = self.num_layers
        records["block_bytes"] = self.block_bytes

    def slot_ptr(self, block_id: int) -> int:
        return self.base_ptr + block_id * self.record_bytes

    def write(self, block_ids: Sequence[int], key_digests: Sequence[int],
              layer_digests: np.ndarray) -> None:
        """Fill the slots of ``block_ids`` (distinct) with their key digests and
        ``layer_digests`` (shape ``(len(block_ids), num_layers)``, uint64)."""
        ids = np.asarray(block_ids, dtype=np.intp)
        self.records["key_digest"][ids] = np.asarray(key_digests, dtype="<u8")
        self.records["layer_digests"][ids] = layer_digests

    def algorithms(self, block_ids: Sequence[int]) -> np.ndarray:
        """The ``algorithm`` field of the slots of ``block_ids`` (what each record's writer
        digested with; checked again, with the rest of the header, by :meth:`failures`)."""
        return np.asarray(self.records["algorithm"][np.asarray(block_ids, dtype=np.intp)])

    def failures(self, block_ids: Sequence[int], key_digests: Sequence[int],
                 layer_digests: np.ndarray, algorithm: str = ALGORITHM,
                 ) -> list[tuple[int, RecordCheck]]:
        """``(position, check)`` of every record among the slots of ``block_ids`` that does not
        vouch for the bytes that landed in KV memory (``layer_digests`` as in :meth:`write`,
        taken with ``algorithm``, ``key_digests`` of the keys the records were got from);
        empty when all match."""
        ids = np.asarray(block_ids, dtype=np.intp)
        got = self.records[ids]
        expected_algorithm = algorithm_id(algorithm)
        header_ok = ((got["magic"] == MAGIC) & (got["record_version"] == RECORD_VERSION)
                     & (got["digest_version"] == DIGEST_VERSION)
                     & (got["algorithm"] == expected_algorithm)
                     & (got["num_layers"] == self.num_layers)
                     & (got["block_bytes"] == self.block_bytes))
        key_ok = got["key_digest"] == np.asarray(key_digests, dtype="<u8")
        equal = got["layer_digests"] == layer_digests
        good = header_ok & key_ok & equal.all(axis=1)
        out = []
        for i in np.flatnonzero(~good).tolist():  # none in the usual load
            if not header_ok[i]:
                out.append((i, RecordCheck(RecordVerdict.INVALID, reason=_header_reason(
                    got[i], self.num_layers, self.block_bytes, expected_algorithm))))
            elif not key_ok[i]:
                out.append((i, RecordCheck(RecordVerdict.FOREIGN, reason=(
                    f"key_digest {int(got['key_digest'][i]):#018x}: a record of another "
                    f"key"))))
            else:
                out.append((i, RecordCheck(RecordVerdict.MISMATCH,
                                           layer_position=int(np.argmin(equal[i])))))
        return out

    def stored_digest(self, block_id: int, layer_position: int) -> int:
        return int(self.records["layer_digests"][block_id][layer_position])


def _header_reason(record: np.void, num_layers: int, block_bytes: int,
                   algorithm: int) -> str:
    expected = {"magic": MAGIC, "record_version": RECORD_VERSION,
                "digest_version": DIGEST_VERSION, "algorithm": algorithm,
                "num_layers": num_layers, "block_bytes": block_bytes}
    for name, want in expected.items():
        value = record[name]
        value = bytes(value) if name == "magic" else int(value)
        if value != want:
            return f"{name} {value!r}, expected {want!r}"
    return "header"
