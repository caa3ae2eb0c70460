"""The PD connector's settings (``kv_connector_extra_config``), parsed once at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.auth import ClusterAuth, SecretError, insecure_from_env, resolve_secret
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.params import TransferMode
from kvbridge.connectors.verify_config import VERIFY_KEYS, VerifySettings, parse_verify
from kvbridge.layouts.digests import ALGORITHMS, SLICE_ALGORITHMS

#: agents a rank may move one transfer's parts over (``lanes``); an adapter with fewer
#: refuses more when it makes its transport
DEFAULT_LANES = 2
MAX_LANES = 16


@dataclass(frozen=True)
class PdSettings(VerifySettings):
    """Validated extra config of a PD connector (every transport adapter shares them).

    ``lease_s``: how long a producer holds a finished request's blocks without
    hearing from a consumer (heartbeats renew it; default 30 s).
    ``transfer_timeout_s``: deadline of one request's load on a consumer rank,
    from the moment its blocks are allocated to the producer's last ack.
    ``handshake_timeout_s`` x (``handshake_retries`` + 1) bounds one handshake.
    ``host``/``port``: where this engine's side channel listens (port 0: any).
    ``advertise_host``: the host put in transfer params (default ``host``).
    ``revalidate_s``: a peer session idle longer than this is re-checked (cheap
    conditional handshake, in the background) when next used, so a restarted
    peer is noticed and re-handshaken even when no transfer to it fails.
    ``idle_progress_ms``: a rank whose engine made no hook call for this long is
    progressed by the worker's pump thread (0: no pump). ``busy_progress_ms``:
    the pump's interval while a peer may be waiting on this rank (blocks held
    under a lease, loads, pushes); a producer answers a consumer's ``begin`` and
    acks its read within about this much (one idle progress costs ~7 us, so
    0.2 ms is ~4% of a core). ``read_progress_ms``: the interval while a READ
    of this rank is in flight (consumer): with a transport that has no progress
    thread the READ moves, and its completion is seen, only when the rank
    progresses, so this bounds the READ's time; it lasts only as long as the
    READ (the adapter's page says what it measured).
    ``lanes``: how many agents of a rank move the parts of one large
    host-memory READ or WRITE at once (default 2; 1: one agent), for a
    transport that has them; one without refuses more than 1. Its adapter's
    page says what lanes gain there.
    ``verify``: how a consumer checks the blocks it read (pull) or was written
    (push) against the producer's digests (``layouts.digests``): ``sample``
    (default: ``verify_sample``, 1/16, of each request's blocks, chosen
    deterministically), ``full`` or ``off``; a producer with ``off`` offers no
    digests (and spends nothing taking them). ``verify_allow_unverified``: a
    load that cannot be checked (a producer that offers no digests, head slices
    at heterogeneous TP) is still served, counted as ``blocks_unverified``;
    False fails it instead. (Fields of :class:`VerifySettings`.)
    ``auth_secret_file``: a file holding the cluster secret (:mod:`kvbridge.auth`)
    that seals the side channel and the ``hello`` of every transport peer; default
    the environment (``KVBRIDGE_SECRET_FILE`` or ``KVBRIDGE_SECRET``). The value
    itself is not a setting: engines log their config. Without a secret the side
    channel listens on loopback only, unless ``insecure_no_auth`` (or
    ``KVBRIDGE_INSECURE_NO_AUTH=1``) says to serve strangers too.
    ``verify_algorithms``: the digest algorithms this rank computes and asks
    for, preferred first (``layouts.digests``: ``xxh3-64``, ``torch-mix64-v1``);
    empty (default): both, XXH3-64 first; XXH3-64 is left out when the KV is in
    GPU memory (the torch one runs on the tensors' device). A consumer asks a
    producer for the first of its own that the producer offers. Head-slice
    digests (``xxh3-64-slices``, ``torch-mix64-v1-slices``) are not listed here:
    a rank that computes a block algorithm offers and asks for its slice
    digests too, in the same order (listing them is an error).
    """

    mode: TransferMode = TransferMode.PULL
    lease_s: float = 30.0
    heartbeat_s: float | None = None  # default lease_s / 3
    transfer_timeout_s: float = 10.0
    handshake_timeout_s: float = 2.0
    handshake_retries: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    early_grace_s: float = 10.0
    revalidate_s: float = 5.0
    idle_progress_ms: float = 5.0
    busy_progress_ms: float = 0.2
    read_progress_ms: float = 0.05
    lanes: int = DEFAULT_LANES
    auth_secret_file: str | None = None
    insecure_no_auth: bool = False
    verify_algorithms: tuple[str, ...] = ()

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    def cluster_auth(self) -> ClusterAuth | None:
        """The configured secret's seal (read now: the file or the environment), or None."""
        try:
            secret = resolve_secret(file=self.auth_secret_file)
        except SecretError as exc:
            raise ConfigError("kv_connector_extra_config.auth_secret_file"
                              if self.auth_secret_file else exc.source, exc.reason) from None
        return ClusterAuth(secret) if secret is not None else None

    @property
    def serves_strangers(self) -> bool:
        """Whether the operator asked to serve a non-loopback side channel unauthenticated."""
        return self.insecure_no_auth or insecure_from_env()

    @classmethod
    def parse(cls, extra: Mapping[str, Any], connector: str = "pd") -> PdSettings:
        """``extra`` checked key by key; ``connector`` names the connector in errors."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}",
                              f"unknown setting of connector {connector!r}; expected one of "
                              f"{sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in extra.items():
            where = f"kv_connector_extra_config.{key}"
            if key == "mode":
                try:
                    values[key] = TransferMode(value)
                except ValueError:
                    raise ConfigError(where, f"expected 'pull' or 'push', got {value!r}") from None
            elif key in VERIFY_KEYS:
                continue  # below, together
            elif key == "auth_secret_file":
                if value is not None and (not isinstance(value, str) or not value):
                    raise ConfigError(where, f"expected a file path, got {value!r}")
                values[key] = value
            elif key == "insecure_no_auth":
                if not isinstance(value, bool):
                    raise ConfigError(where, f"expected true or false, got {value!r}")
                values[key] = value
            elif key == "verify_algorithms":
                sliced = next((v for v in value if v in SLICE_ALGORITHMS), None) \
                    if isinstance(value, list | tuple) else None
                if sliced is not None:
                    raise ConfigError(where, f"{sliced!r} is not a block digest algorithm: "
                                             f"it is offered with "
                                             f"{SLICE_ALGORITHMS[sliced]!r} (the same "
                                             f"digester); list {SLICE_ALGORITHMS[sliced]!r}")
                if (not isinstance(value, list | tuple) or not value
                        or not all(isinstance(v, str) for v in value)
                        or any(v not in ALGORITHMS for v in value)):
                    raise ConfigError(where, f"expected a non-empty list of digest algorithms "
                                             f"of {list(ALGORITHMS)}, got {value!r}")
                values[key] = tuple(dict.fromkeys(value))
            elif key in ("host", "advertise_host"):
                if value is not None and (not isinstance(value, str) or not value):
                    raise ConfigError(where, f"expected a host name or address, got {value!r}")
                values[key] = value
            elif key in ("port", "handshake_retries"):
                hi = 65536 if key == "port" else 100
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < hi:
                    raise ConfigError(where, f"expected an integer in [0, {hi}), got {value!r}")
                values[key] = value
            elif key == "lanes":
                if (not isinstance(value, int) or isinstance(value, bool)
                        or not 1 <= value <= MAX_LANES):
                    raise ConfigError(where, f"expected an integer in [1, {MAX_LANES}], "
                                             f"got {value!r}")
                values[key] = value
            elif key in ("idle_progress_ms", "busy_progress_ms", "read_progress_ms"):
                # idle 0 turns the pump off; a busy interval of 0 would spin
                low_ok = key == "idle_progress_ms"
                if (not isinstance(value, int | float) or isinstance(value, bool)
                        or value < 0 or (value == 0 and not low_ok)):
                    raise ConfigError(where, f"expected milliseconds {'>=' if low_ok else '>'} 0,"
                                             f" got {value!r}")
                values[key] = float(value)
            else:
                if value is None and key == "heartbeat_s":
                    values[key] = None
                    continue
                if (not isinstance(value, int | float) or isinstance(value, bool)
                        or not value > 0):
                    raise ConfigError(where, f"expected a number of seconds > 0, got {value!r}")
                values[key] = float(value)
        policy = parse_verify(extra)
        return cls(**values, verify=policy.mode, verify_sample=policy.sample_fraction,
                   verify_allow_unverified=policy.allow_unverified)
