"""fsck of the ``obj`` tier: verify (and carefully repair) the block objects in Mooncake.

Owns the scan of the obj tier's objects only; it may not touch objects outside the
tier's namespace (``kvbridge/offload/<fingerprint>/``) nor the fs tier (``fsck``).

Mooncake's client cannot list keys; its master can: ``GET /get_all_keys`` on the
master's HTTP port (``--metrics_port``; ``kvbridge mooncake master`` prints it as
``metrics_url``) answers every key, one per line. The list is read within one
overall deadline (``--list-deadline``, default 60 s: a trickling port cannot hold
fsck), up to ``--max-keys`` keys (default 1,000,000) and ``MAX_KEY_LIST_BYTES``;
past either bound nothing is checked and the error names the bound. Names that
are not the obj tier's are ignored (counted), a name under its prefix that it
would not write is reported (``unknown_file``).

Per block object ``<prefix><32 hex>`` and its digest object ``<name>.dg``
(``kvbridge.offload.obj``): the digest object (at most ``MAX_BLOCK_HEADER_BYTES``)
is decoded as a block header and must name the key hash in the object's name;
the block object is read (into registered staging memory, at most
``MAX_STAGING_BYTES`` at once; a header naming a block over ``MAX_SPAN_BYTES`` is
torn, never allocated) and must be exactly the header's ``block_bytes``, and its
bytes must match the header's layer digests. What is provably broken, and the
only thing ``repair`` removes (both objects of the pair):

* bytes that do not match their digests (``digest_mismatch``: another key's bytes
  under this name, or changed ones);
* a torn digest object, or one naming another key (``corrupt_header``);
* a block object whose size is not the header's (``short_block`` / ``oversize_block``);
* a digest object without its block (``orphan_digest``): Mooncake evicted the block
  alone; since puts never overwrite, the stale digests would fail the block's next
  store-and-load, so removing them is the repair.

A block without a digest object (written with ``verify`` off, or its digests
evicted apart) is counted unverified, not a finding. A get that fails for another
reason (timeout, the object evicted meanwhile) is reported (``unreadable_block``)
and kept: it says nothing about the object. A pair removed by repair may have been
stored again between the scan and the removal; that costs one miss, never wrong KV.
"""

from __future__ import annotations

import http.client
import io
import mmap
import re
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.mooncake import KeyResult, MooncakeStoreClient
from kvbridge.offload.blockdigest import first_mismatch, layer_digests
from kvbridge.offload.fs_io import MAX_BLOCK_HEADER_BYTES, BadBlockHeaderError, decode_block_header
from kvbridge.offload.fsck import MAX_SPAN_BYTES, Finding, FindingKind, FsckReport
from kvbridge.offload.obj import OBJECT_ROOT, ObjTier
from kvbridge.offload.types import OffloadError

DIGEST_SUFFIX = ObjTier.DIGEST_SUFFIX
#: what the obj tier names its objects (``ObjTier.object_name`` / ``digest_name``)
OBJECT_RE = re.compile(rf"^{re.escape(OBJECT_ROOT)}([0-9a-f]{{8,64}})/([0-9a-f]{{32}})"
                       rf"({re.escape(DIGEST_SUFFIX)})?$")
#: the most of the master's key list that is read (a list longer than this is refused)
MAX_KEY_LIST_BYTES = 256 << 20
#: the whole key listing must be done within this (``--list-deadline``); a master lists
#: a million keys in about a second, so this leaves room for a slow link, not a trickle
DEFAULT_LIST_DEADLINE_S = 60.0
#: keys listed at most (``--max-keys``): an obj tier holds two objects per block, so
#: this is half a million blocks; a longer list is refused before it is all read
DEFAULT_MAX_KEYS = 1_000_000
_LIST_CHUNK_BYTES = 1 << 16
#: registered staging memory for the blocks read at once
MAX_STAGING_BYTES = 64 << 20


@dataclass
class ObjFsckReport(FsckReport):
    #: keys the master listed that are not the obj tier's (other users of the store)
    other_objects: int = 0

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["other_objects"] = self.other_objects
        return out


@dataclass
class _Pair:
    fingerprint: str
    name: str
    block: bool = False
    digests: bool = False


@dataclass
class _Checked:
    """A pair whose digest object was read: what its header says."""
    pair: _Pair
    block_bytes: int
    num_layers: int
    layers: tuple[int, ...] | None = None


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by what is left of one overall deadline.

    ``http.client`` bounds each ``recv`` by the socket timeout only, so a server that
    sends a byte every few seconds (status line, headers or body) would hold it
    forever; this makes the whole exchange end at ``deadline`` (``time.monotonic()``).
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise _ListDeadline()
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise _ListDeadline() from None


class _ListDeadline(Exception):
    """The key list's overall deadline passed."""


class _DeadlineSocket:
    """What ``http.client`` needs of a socket, its reads bounded by ``_DeadlineReader``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        assert mode == "rb"
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def sendall(self, data: bytes) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise _ListDeadline()
        self._sock.settimeout(remaining)
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise _ListDeadline() from None

    def close(self) -> None:
        """Nothing: ``http.client`` closes its connection while the response still reads
        from it (a ``Connection: close`` reply); ``list_keys`` closes the socket itself."""


def list_keys(master_http: str, timeout_s: float = DEFAULT_LIST_DEADLINE_S,
              max_keys: int = DEFAULT_MAX_KEYS) -> list[str]:
    """Every key the master holds (``GET /get_all_keys`` on its HTTP port), bounded.

    ``timeout_s``: the deadline of the whole listing (connect, headers, every byte of
    the list), not of each read. ``max_keys``: more lines than this, and the list is
    refused. Also refused: a list over ``MAX_KEY_LIST_BYTES``. Each refusal raises
    ``OffloadError`` whose field names the bound (``list_deadline``, ``max_keys``,
    ``master_http``), after reading no more than the bound allows.
    """
    url = master_http if "://" in master_http else f"http://{master_http}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise OffloadError("master_http", f"expected http://HOST:PORT of the master's HTTP "
                           f"(metrics) port, got {master_http!r}")
    if not timeout_s > 0 or max_keys < 1:
        raise OffloadError("list_deadline" if not timeout_s > 0 else "max_keys",
                           f"expected > 0, got {timeout_s if not timeout_s > 0 else max_keys}")
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    body = bytearray()
    lines = 0
    raw: socket.socket | None = None
    try:
        conn.connect()
        raw = conn.sock
        assert raw is not None
        conn.sock = _DeadlineSocket(raw, deadline)
        conn.request("GET", "/get_all_keys")
        response = conn.getresponse()
        if response.status != 200:
            raise OffloadError("master_http", f"GET {url}/get_all_keys answered "
                               f"{response.status} {response.reason}")
        while True:
            chunk = response.read1(_LIST_CHUNK_BYTES)
            if not chunk:
                break
            body += chunk
            lines += chunk.count(b"\n")
            if lines > max_keys:
                raise OffloadError("max_keys", f"the master at {url} lists more than "
                                   f"{max_keys} keys (--max-keys); read {len(body)} bytes, "
                                   "nothing checked. Raise --max-keys for a store this big")
            if len(body) > MAX_KEY_LIST_BYTES:
                raise OffloadError("master_http", f"the master's key list is over "
                                   f"{MAX_KEY_LIST_BYTES} bytes; not read")
    except _ListDeadline:
        raise OffloadError("list_deadline", f"the master at {url} did not list its keys "
                           f"within {timeout_s:g} s (--list-deadline; {len(body)} bytes, "
                           f"{lines} keys read); nothing checked") from None
    except (OSError, http.client.HTTPException) as exc:
        raise OffloadError("master_http", f"GET {url}/get_all_keys: {exc}") from None
    finally:
        conn.close()
        if raw is not None:
            raw.close()
    keys = [line for line in body.decode("utf-8", "replace").splitlines() if line]
    if len(keys) > max_keys:   # a last line without its newline
        raise OffloadError("max_keys", f"the master at {url} lists more than {max_keys} "
                           "keys (--max-keys); nothing checked")
    return keys


class _Staging:
    """Page-aligned memory registered with the client for zero-copy gets."""

    def __init__(self, client: MooncakeStoreClient, nbytes: int) -> None:
        self._client = client
        self._mmap = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._mmap)
        self.ptr = int(np.frombuffer(self._mmap, dtype=np.uint8).ctypes.data)
        client.register_buffer(self.ptr, nbytes)

    def close(self) -> None:
        self._client.unregister_buffer(self.ptr)
        self.view.release()
        self._mmap.close()


def _batches(items: Sequence[_Checked], per_batch: int) -> Iterable[Sequence[_Checked]]:
    for start in range(0, len(items), per_batch):
        yield items[start:start + per_batch]


def fsck_obj(client: MooncakeStoreClient, master_http: str, *, repair: bool = False,
             fingerprint: str | None = None, digests: bool = True,
             keys: Sequence[str] | None = None,
             progress: Callable[[str], None] | None = None,
             list_deadline_s: float = DEFAULT_LIST_DEADLINE_S,
             max_keys: int = DEFAULT_MAX_KEYS) -> ObjFsckReport:
    """Scan the obj tier's objects (``keys``: the key list, else asked of the master,
    within ``list_deadline_s`` and at most ``max_keys``: see :func:`list_keys`)."""
    report = ObjFsckReport(root=f"mooncake {master_http}")
    pairs: dict[str, _Pair] = {}
    if keys is None:
        keys = list_keys(master_http, list_deadline_s, max_keys)
    for key in keys:
        if not key.startswith(OBJECT_ROOT):
            report.other_objects += 1
            continue
        match = OBJECT_RE.match(key)
        if match is None:
            report.findings.append(Finding(FindingKind.UNKNOWN_FILE, key,
                                           "not a name the obj tier writes"))
            continue
        fp, digest = match.group(1), match.group(3) is not None
        name = key[:-len(DIGEST_SUFFIX)] if digest else key
        pair = pairs.setdefault(name, _Pair(fp, name))
        if digest:
            pair.digests = True
        else:
            pair.block = True
    checked: list[_Checked] = []
    for pair in pairs.values():
        if fingerprint is not None and pair.fingerprint != fingerprint:
            report.findings.append(Finding(FindingKind.FOREIGN_LAYOUT, pair.name,
                                           f"layout {pair.fingerprint}, not {fingerprint}"))
        elif not pair.digests:
            report.blocks_ok += 1
            report.blocks_unverified += 1
        elif not pair.block:
            report.findings.append(Finding(FindingKind.ORPHAN_DIGEST, pair.name + DIGEST_SUFFIX,
                                           "digests of a block that is not stored"))
        else:
            checked.append(_Checked(pair, 0, 0))
    _read_headers(client, checked, report)
    if digests:
        _check_blocks(client, [c for c in checked if c.block_bytes], report, progress)
    else:
        report.blocks_ok += sum(1 for c in checked if c.block_bytes)
    if repair:
        _repair(client, report)
    return report


def _read_headers(client: MooncakeStoreClient, checked: list[_Checked],
                  report: ObjFsckReport) -> None:
    """Read each pair's digest object; a pair that fails is a finding (``block_bytes`` 0)."""
    per_batch = min(max(1, MAX_STAGING_BYTES // MAX_BLOCK_HEADER_BYTES), len(checked))
    staging = _Staging(client, per_batch * MAX_BLOCK_HEADER_BYTES) if checked else None
    try:
        for batch in _batches(checked, per_batch):
            assert staging is not None
            names = [c.pair.name + DIGEST_SUFFIX for c in batch]
            results = client.batch_get_into(
                names, [staging.ptr + i * MAX_BLOCK_HEADER_BYTES for i in range(len(batch))],
                [MAX_BLOCK_HEADER_BYTES] * len(batch), exact_size=False)
            for i, (item, result) in enumerate(zip(batch, results, strict=True)):
                if not result.ok:
                    report.findings.append(Finding(FindingKind.UNREADABLE_BLOCK, names[i],
                                                   f"get failed: {result}"))
                    continue
                start = i * MAX_BLOCK_HEADER_BYTES
                data = bytes(staging.view[start:start + result.nbytes])
                try:
                    header = decode_block_header(names[i], data)
                    if header.key_hash.hex() != item.pair.name.rsplit("/", 1)[1]:
                        raise BadBlockHeaderError(names[i], "the digests of another key",
                                                  True)
                    if not 0 < header.block_bytes <= MAX_SPAN_BYTES:
                        raise BadBlockHeaderError(names[i], f"a block of {header.block_bytes} "
                                                  "bytes (torn header)", True)
                except BadBlockHeaderError as exc:
                    kind = (FindingKind.CORRUPT_HEADER if exc.corrupt
                            else FindingKind.FOREIGN_FORMAT)
                    report.findings.append(Finding(kind, item.pair.name, exc.reason))
                    continue
                item.block_bytes = header.block_bytes
                item.num_layers = header.num_layers
                item.layers = header.layer_digests
                report.layouts.setdefault(item.pair.fingerprint, header.block_bytes)
    finally:
        if staging is not None:
            staging.close()


def _check_blocks(client: MooncakeStoreClient, checked: list[_Checked],
                  report: ObjFsckReport, progress: Callable[[str], None] | None) -> None:
    """Read each block (size checked: one byte of room shows an oversize object) and
    compare its bytes with its header's layer digests."""
    by_size: dict[int, list[_Checked]] = {}
    for item in checked:
        by_size.setdefault(item.block_bytes, []).append(item)
    done = 0
    for block_bytes, items in sorted(by_size.items()):
        room = block_bytes + 1
        per_batch = max(1, MAX_STAGING_BYTES // room)
        staging = _Staging(client, min(per_batch, len(items)) * room)
        try:
            for batch in _batches(items, per_batch):
                results: list[KeyResult] = client.batch_get_into(
                    [c.pair.name for c in batch],
                    [staging.ptr + i * room for i in range(len(batch))],
                    [room] * len(batch), exact_size=False)
                for i, (item, result) in enumerate(zip(batch, results, strict=True)):
                    _judge(item, result, staging.view[i * room:i * room + block_bytes],
                           report)
                done += len(batch)
                if progress is not None:
                    progress(f"{done}/{len(checked)} blocks checked")
        finally:
            staging.close()


def _judge(item: _Checked, result: KeyResult, data: memoryview,
           report: ObjFsckReport) -> None:
    name = item.pair.name
    if not result.ok:
        report.findings.append(Finding(FindingKind.UNREADABLE_BLOCK, name,
                                       f"get failed: {result}"))
        return
    if result.nbytes != item.block_bytes:
        short = result.nbytes < item.block_bytes
        size = f"{result.nbytes} bytes" if short else f"over {item.block_bytes} bytes"
        report.findings.append(Finding(
            FindingKind.SHORT_BLOCK if short else FindingKind.OVERSIZE_BLOCK, name,
            f"{size}; its header says {item.block_bytes}"))
        return
    if item.layers is None:                    # a header written with verification off
        report.blocks_ok += 1
        report.blocks_unverified += 1
        return
    actual = layer_digests([data], item.num_layers)
    layer = first_mismatch(item.layers, actual)
    if layer is not None:
        report.findings.append(Finding(
            FindingKind.DIGEST_MISMATCH, name,
            f"layer {layer} of {item.num_layers}: digest {actual[layer]:016x}, its header "
            f"says {item.layers[layer]:016x}"))
        return
    report.blocks_ok += 1
    report.blocks_verified += 1


def _repair(client: MooncakeStoreClient, report: ObjFsckReport) -> None:
    """Remove both objects of each provably broken pair (an orphan: its digest object)."""
    for finding in report.findings:
        if not finding.broken:
            continue
        if finding.kind is FindingKind.ORPHAN_DIGEST:
            names = [finding.path]
        else:
            names = [finding.path, finding.path + DIGEST_SUFFIX]
        results = client.remove(names, force=True)
        finding.repaired = all(r.ok or r.not_found for r in results)
        if not finding.repaired:
            finding.detail += f"; remove failed: {[str(r) for r in results]}"
