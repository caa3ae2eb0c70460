"""Settings of the Mooncake store connector (``kv_connector_extra_config``), parsed once.

Keys (all optional except the two addresses)::

    master_address        "host:port" of mooncake_master's RPC service (required)
    metadata_server       its HTTP metadata URL, e.g. "http://127.0.0.1:8080/metadata" (required)
    global_segment_size   bytes each worker client lends to the store (default 64 MiB)
    local_buffer_size     bytes of each client's staging buffer (default 16 MiB)
    staging_bytes         KV the host cannot read (GPU memory): bytes of the worker's own
                          host staging buffer that puts and gets go through, half each,
                          pinned on a GPU (default 256 MiB; at most twice the rank's KV
                          is used); a batch beyond a half is cut
                          into rounds; a block of one layer must fit in a half
    protocol              "tcp" (default) or "rdma"; device_name for rdma
    op_timeout_s          bound of each Mooncake batch call (default 5.0), and of the
                          wait for the step's KV kernels (GPU fence) before a put
    lookup_timeout_s      a lookup unanswered this long is a miss (default op_timeout_s + 1)
    load_async            loads run on a worker thread across steps (default true)
    lookup                this engine looks blocks up and loads them (default true;
                          producers too: prefix reuse across instances)
    lookup_every_layer    a lookup checks every layer's key (default true); false checks
                          one key (the last layer) per namespace and block, for deep models
    client_scope          "process" (default): halves in one process share one client per
                          store; "engine": one client per engine (cross-instance tests)
    scheduler_segment_size bytes the scheduler half's own client lends when it cannot
                          share a worker's (default 0: it only checks existence)
    reconnect_interval_s  how often a half without a client retries setup (default 1.0)
    abandon_grace_s       after a get or put timed out, wait this long (bounded) for the
                          abandoned call before reporting its blocks failed / ending the
                          step, so a late transfer cannot touch a block the engine
                          reuses (default 5.0)
    verify                "sample" (default): a deterministic fraction (verify_sample)
                          of each load's blocks is checked against the digest record
                          its writer put next to it before it is reported loaded;
                          "full": every loaded block; "off": nothing is checked (and
                          no record is fetched). The default is measured: full costs
                          15-55 % of a get here (docs/verified-kv.md). A writer puts a
                          record with every block unless this is "off" (see
                          :mod:`.records`; readers then load its blocks unverified).
    verify_sample         the fraction checked in "sample" mode, in (0, 1] (default 1/16)
    verify_allow_unverified  a block stored without a record (an older version, a
                          writer with verify "off"), or whose record names an algorithm
                          this rank cannot take, is loaded unverified and counted
                          (default true); false reports it as a load error instead
    verify_algorithm      what this rank's records are digested with: "auto" (default:
                          "xxh3-64" for KV in host memory, "torch-mix64-v1" for KV in
                          device memory) or either name; a reader checks each record
                          with the algorithm it names. Engines with KV in device memory
                          read "xxh3-64" records unverified: where such engines share a
                          store with host ones, give the host ones "torch-mix64-v1"
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.backends.mooncake import MooncakeConfig, MooncakeConfigError, Protocol
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.verify_config import VerifySettings, parse_verify
from kvbridge.layouts.digests import ALGORITHMS

MiB = 1 << 20
_FIELD = "kv_connector_extra_config"
#: host memory a worker may stage device KV through (pinned memory is scarce)
MAX_STAGING_BYTES = 64 << 30


class ClientScope(str, enum.Enum):
    PROCESS = "process"
    ENGINE = "engine"


@dataclass(frozen=True)
class MooncakeStoreSettings(VerifySettings):
    master_address: str
    metadata_server: str
    global_segment_size: int = 64 * MiB
    local_buffer_size: int = 16 * MiB
    staging_bytes: int = 256 * MiB
    protocol: str = "tcp"
    device_name: str = ""
    op_timeout_s: float = 5.0
    lookup_timeout_s: float = 6.0
    load_async: bool = True
    lookup: bool = True
    lookup_every_layer: bool = True
    client_scope: ClientScope = ClientScope.PROCESS
    scheduler_segment_size: int = 0
    reconnect_interval_s: float = 1.0
    abandon_grace_s: float = 5.0
    verify_algorithm: str = "auto"

    def client_config(self, *, segment_size: int | None = None) -> MooncakeConfig:
        """The store client's config (worker halves lend ``global_segment_size``)."""
        return MooncakeConfig(
            master_address=self.master_address, metadata_server=self.metadata_server,
            global_segment_size=self.global_segment_size if segment_size is None
            else segment_size,
            local_buffer_size=self.local_buffer_size, protocol=Protocol(self.protocol),
            device_name=self.device_name, op_timeout_s=self.op_timeout_s)

    def to_extra(self) -> dict[str, Any]:
        """The extra-config dict that parses back to these settings."""
        out: dict[str, Any] = {}
        for name in _SPEC:
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, enum.Enum) else value
        return out


_INT = ("global_segment_size", "local_buffer_size", "scheduler_segment_size", "staging_bytes")
_FLOAT = ("op_timeout_s", "lookup_timeout_s", "reconnect_interval_s", "abandon_grace_s")
_BOOL = ("load_async", "lookup", "lookup_every_layer", "verify_allow_unverified")
_STR = ("master_address", "metadata_server", "protocol", "device_name", "client_scope",
        "verify", "verify_algorithm")
_SPEC = (*_STR, *_INT, *_FLOAT, *_BOOL, "verify_sample")


def parse_settings(extra: Mapping[str, Any]) -> MooncakeStoreSettings:
    """Validate ``extra``; a :class:`ConfigError` names the first bad key and what it expects."""
    if not isinstance(extra, Mapping):
        raise ConfigError(_FIELD, f"expected a mapping, got {type(extra).__name__}")
    for key in extra:
        if key not in _SPEC:
            raise ConfigError(f"{_FIELD}.{key}", f"unknown setting; expected one of "
                                                 f"{sorted(_SPEC)}")
    values: dict[str, Any] = {}
    for key in ("master_address", "metadata_server"):
        value = extra.get(key)
        if not isinstance(value, str) or not value:
            example = "127.0.0.1:50051" if key == "master_address" else \
                "http://127.0.0.1:8080/metadata"
            raise ConfigError(f"{_FIELD}.{key}", f"required: a non-empty string such as "
                                                 f"{example!r} (`kvbridge mooncake master` "
                                                 f"prints both)")
        values[key] = value
    for key in ("protocol", "device_name", "client_scope", "verify", "verify_algorithm"):
        if key in extra:
            if not isinstance(extra[key], str):
                raise ConfigError(f"{_FIELD}.{key}", f"expected a string, got {extra[key]!r}")
            values[key] = extra[key]
    for key in _INT:
        if key in extra:
            value = extra[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{_FIELD}.{key}", f"expected bytes as an integer >= 0, "
                                                     f"got {value!r}")
            values[key] = value
    for key in _FLOAT:
        if key in extra:
            value = extra[key]
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{_FIELD}.{key}", f"expected seconds > 0, got {value!r}")
            values[key] = float(value)
    for key in _BOOL:
        if key in extra:
            if not isinstance(extra[key], bool):
                raise ConfigError(f"{_FIELD}.{key}", f"expected true or false, "
                                                     f"got {extra[key]!r}")
            values[key] = extra[key]
    if not 2 <= values.get("staging_bytes", 2) <= MAX_STAGING_BYTES:
        raise ConfigError(f"{_FIELD}.staging_bytes", f"expected bytes in [2, "
                                                     f"{MAX_STAGING_BYTES}] (two halves), got "
                                                     f"{values['staging_bytes']!r}")
    if "client_scope" in values:
        try:
            values["client_scope"] = ClientScope(values["client_scope"])
        except ValueError:
            raise ConfigError(f"{_FIELD}.client_scope",
                              f"expected one of {[s.value for s in ClientScope]}, "
                              f"got {values['client_scope']!r}") from None
    if values.get("verify_algorithm", "auto") not in ("auto", *ALGORITHMS):
        raise ConfigError(f"{_FIELD}.verify_algorithm", f"expected 'auto' or one of "
                                                        f"{list(ALGORITHMS)}, got "
                                                        f"{values['verify_algorithm']!r}")
    policy = parse_verify(extra, _FIELD)
    values["verify"] = policy.mode
    values["verify_sample"] = policy.sample_fraction
    values["verify_allow_unverified"] = policy.allow_unverified
    if "lookup_timeout_s" not in values:
        values["lookup_timeout_s"] = values.get("op_timeout_s", 5.0) + 1.0
    settings = MooncakeStoreSettings(**values)
    try:  # the backend's own checks (address forms, protocol, rdma device)
        settings.client_config()
    except MooncakeConfigError as exc:
        raise ConfigError(_FIELD, str(exc)) from None
    return settings
