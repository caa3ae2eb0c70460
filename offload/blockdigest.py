"""Block digests as the offload tiers keep them: one XXH3-64 per layer span of a block.

A tier's block (``block_bytes``) is one rank's bytes of one block across its
layers of a region, layer after layer (``connectors.offloading.worker``); the
tier is told how many equal layer spans it holds (``num_layers``, 1 when the
layers are not known or not equal). The digests are those of
:mod:`kvbridge.layouts.digests`: a layer digest is XXH3-64 of the block's span
in one layer, the block digest is :func:`~kvbridge.layouts.digests.combine` of
them, so a mismatch names the layer.

Pure: no I/O, no threads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.layouts.digests import DigestMode, VerifyPolicy, combine, digest_fast
from kvbridge.offload.types import OffloadError, OffloadKey

#: layer digests of one block, in layer order
LayerDigests = tuple[int, ...]

#: the policy of a tier built without one: every block checked, the safe choice for a
#: caller that did not decide (the offloading connector picks per tier, by cost)
DEFAULT_VERIFY = VerifyPolicy(DigestMode.FULL)


def check_num_layers(block_bytes: int, num_layers: int) -> int:
    """``num_layers`` if ``block_bytes`` splits into that many equal spans; else OffloadError."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1 \
            or block_bytes % num_layers:
        raise OffloadError("num_layers", f"expected a count >= 1 of equal layer spans of "
                           f"block_bytes={block_bytes}, got {num_layers!r}")
    return num_layers


def _flat(views: Sequence[memoryview]) -> list[memoryview]:
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def layer_digests(views: Sequence[memoryview], num_layers: int) -> LayerDigests:
    """XXH3-64 of each of ``num_layers`` equal spans of the bytes of ``views`` (in order).

    Hashes in place when a span lies in one view (the usual case: one slot view
    per block); a span across views is joined first (a copy).
    """
    flat = _flat(views)
    total = sum(len(v) for v in flat)
    span = total // num_layers
    view = flat[0] if len(flat) == 1 else memoryview(b"".join(bytes(v) for v in flat))
    # the C hash mapped over the spans: no Python frame per layer
    return tuple(map(digest_fast, [view[i:i + span] for i in range(0, span * num_layers, span)]))


def first_mismatch(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """The first layer whose digests differ, or None (lengths must be equal)."""
    for layer, (e, a) in enumerate(zip(expected, actual, strict=True)):
        if e != a:
            return layer
    return None


def wants_key(policy: VerifyPolicy, key: OffloadKey) -> bool:
    """Whether a tier checks ``key``'s block under ``policy`` (``sample``: chosen per key,
    deterministically, so every reader of a block makes the same choice)."""
    return policy.wants(key.hex(), 0, 0)


class DigestMismatchError(OSError):
    """A block's bytes landed but do not match the digest stored with them.

    Provable corruption: the writer took the digest of the bytes it wrote.
    ``layer``: the first layer span that differs. ``deleted``: whether the
    tier removed the stored copy (the fs tier removes the file).
    """

    removal_reason = "digest"

    def __init__(self, tier: str, where: str, key: OffloadKey, layer: int, expected: int,
                 actual: int) -> None:
        super().__init__(f"{tier}: digest mismatch in {where} (key {key.hex()}, layer {layer}: "
                         f"expected {expected:016x}, got {actual:016x})")
        self.tier = tier
        self.where = where
        self.key = key
        self.layer = layer
        self.expected = expected
        self.actual = actual
        self.deleted = False


def verify_views(tier: str, where: str, key: OffloadKey, expected: Sequence[int],
                 views: Sequence[memoryview]) -> LayerDigests:
    """Digest ``views`` and compare with ``expected``; raises ``DigestMismatchError``."""
    actual = layer_digests(views, len(expected))
    layer = first_mismatch(expected, actual)
    if layer is not None:
        raise DigestMismatchError(tier, where, key, layer, expected[layer], actual[layer])
    return actual


__all__ = ["DEFAULT_VERIFY", "DigestMismatchError", "LayerDigests", "check_num_layers",
           "combine", "first_mismatch", "layer_digests", "verify_views", "wants_key"]
