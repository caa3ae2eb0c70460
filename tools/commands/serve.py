"""`kvbridge serve`: run one engine (producer or consumer) with the NIXL connector until interrupted.

This is how an operator checks a real link between two machines: on host A
``kvbridge serve --role producer --host A --port 5600`` (side channel on 5600,
engine control on 5601), on host B ``kvbridge demo --producer-addr A:5600``
(only the consumer runs there); ``kvbridge probe A:5600`` shows the metadata.
With a cluster secret (``--secret-file``, or ``KVBRIDGE_SECRET_FILE`` /
``KVBRIDGE_SECRET`` in the environment; :mod:`kvbridge.auth`) the side channel,
the control socket, the events replay socket and every NIXL peer's hello take
sealed requests from members only, and a non-loopback ``--host`` is served.
Without one, ``--host`` must be loopback unless ``--insecure-no-auth`` says to
serve anyone who can reach it (then firewall it, and the NIXL/UCX ports, to
the peers you trust). The control socket's ``shutdown`` op is honoured only on
a loopback ``--host`` (or with ``--allow-remote-shutdown``).

Signals: SIGINT and SIGTERM stop the engine cleanly (exit 0); so does SIGHUP
(the terminal closed) unless it is ignored, as under ``nohup``: then the engine
keeps serving. The engine never exits because its parent did (a shell that
started it in the background may end first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbridge.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    check_bind,
    insecure_from_env,
    is_loopback,
    resolve_auth,
)
from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole
from kvbridge.layouts import LayoutError, load_spec, preset_names
from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import (
    add_device_argument,
    add_topology_arguments,
    device_from_args,
    topology_from_args,
)

if TYPE_CHECKING:
    from kvbridge.engine.core import EngineConfig

SERVE_DIMS = ("tp", "pp")  # the sizes serve takes one per flag (all: --topology)

EPILOG = """\
examples:
  kvbridge auth new-secret --out /etc/kvbridge/cluster.secret   # once; copy to every host
  kvbridge serve --role producer --host 10.0.0.5 --port 5600 \\
      --secret-file /etc/kvbridge/cluster.secret
  kvbridge serve --role producer --model tiny-hybrid --tp 2 --mode push --port 5600 --json
  # then, on another machine (KVBRIDGE_SECRET_FILE names the same secret there):
  KVBRIDGE_SECRET_FILE=/etc/kvbridge/cluster.secret \\
      kvbridge demo --producer-addr 10.0.0.5:5600 --consumer tp=1
  KVBRIDGE_SECRET_FILE=/etc/kvbridge/cluster.secret kvbridge probe 10.0.0.5:5600

--json prints one ready line {"role", "mode", "model", "engine_id", "side_channel",
"control"} once the engine listens.

signals: SIGINT, SIGTERM and SIGHUP stop it cleanly; under `nohup kvbridge serve &`
SIGHUP is ignored and it keeps serving after the shell exits.

exit codes: 0 stopped by a signal or a shutdown request, 2 usage error (a size this
host cannot hold, a port that cannot be bound, ...)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run a producer (or consumer) engine with the NIXL connector",
        description="Run one reference engine with the NIXL connector until interrupted: its "
                    "handshake side channel listens on HOST:PORT and its control socket "
                    "(requests from a router such as `kvbridge demo --producer-addr`) on "
                    "HOST:PORT+1. Prints where it listens.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="producer", choices=["producer", "consumer"])
    parser.add_argument("--mode", default="pull", choices=["pull", "push"])
    parser.add_argument("--model", default="tiny-gqa", metavar="PRESET|FILE",
                        help=f"model preset ({', '.join(preset_names())}) or spec JSON file")
    add_topology_arguments(parser, SERVE_DIMS)
    parser.add_argument("--num-blocks", type=int, default=256, metavar="N")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on and to advertise (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=5600, help="side-channel port (default 5600)")
    parser.add_argument("--control-port", type=int, default=None,
                        help="engine control port (default PORT+1)")
    parser.add_argument("--secret-file", metavar="FILE", default=None,
                        help="the cluster secret (one line; `kvbridge auth new-secret` makes "
                             "one); default KVBRIDGE_SECRET_FILE or KVBRIDGE_SECRET")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="without a secret, serve a non-loopback --host anyway: anyone "
                             "who reaches its ports may fetch its metadata and drive it")
    parser.add_argument("--allow-remote-shutdown", action="store_true",
                        help="honour the control port's shutdown op on a non-loopback --host "
                             "(default: only on loopback)")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--kv-config", metavar="JSON", help="extra connector settings")
    parser.add_argument("--json", action="store_true", help="print the ready line as JSON")
    add_device_argument(parser)
    from kvbridge.tools.events_flags import add_events_arguments, with_engine_events

    add_events_arguments(parser)  # --events-endpoint / --events-replay-endpoint
    parser.set_defaults(func=_with_secret_file(with_engine_events(run)))


def _with_secret_file(run: Callable[[argparse.Namespace], int]
                      ) -> Callable[[argparse.Namespace], int]:
    """``run`` with ``--secret-file`` made this process's secret (``KVBRIDGE_SECRET_FILE``),
    so the side channel, the control port and the events replay socket all use it."""

    def wrapped(args: argparse.Namespace) -> int:
        if args.secret_file:
            os.environ.pop(SECRET_ENV, None)
            os.environ[SECRET_FILE_ENV] = args.secret_file
        return run(args)

    return wrapped


def build_config(args: argparse.Namespace) -> EngineConfig:
    from kvbridge.engine.core import EngineConfig  # imports torch: only when serving

    topology = topology_from_args(args, SERVE_DIMS)
    extra: dict[str, Any] = json.loads(args.kv_config) if args.kv_config else {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_config", "expected a JSON object")
    extra.update({"mode": args.mode, "host": args.host, "port": args.port})
    if args.secret_file:
        extra["auth_secret_file"] = args.secret_file
    if args.insecure_no_auth:
        extra["insecure_no_auth"] = True
    role = KVRole.PRODUCER if args.role == "producer" else KVRole.CONSUMER
    connector = ConnectorConfig.from_dict({"kv_connector": "nixl", "kv_role": role.value,
                                           "engine_id": args.engine_id,
                                           "kv_connector_extra_config": extra})
    return EngineConfig(spec=load_spec(args.model), topology=topology,
                        num_blocks=args.num_blocks, max_num_batched_tokens=4096,
                        max_num_seqs=64, connector=connector, device=device_from_args(args))


class _Announce:
    """Receives the engine server's ready line and prints it for an operator."""

    def __init__(self, args: argparse.Namespace, control_port: int) -> None:
        self.args = args
        self.control_port = control_port

    def write(self, text: str) -> None:
        data = json.loads(text)
        endpoint = data.get("endpoint") or [self.args.host, self.args.port]
        info = {"role": self.args.role, "mode": self.args.mode, "model": self.args.model,
                "engine_id": data["engine_id"], "side_channel": f"{endpoint[0]}:{endpoint[1]}",
                "control": f"{self.args.host}:{data['port']}"}
        if self.args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"kvbridge serve: {self.args.role} engine {info['engine_id']} "
                  f"({self.args.mode}, {self.args.model}); side channel on "
                  f"{info['side_channel']}, control on {info['control']}; Ctrl-C to stop",
                  flush=True)

    def flush(self) -> None:
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.server import serve

    control_port = args.port + 1 if args.control_port is None else args.control_port
    try:
        _check_ports(args.port, control_port)
        config = build_config(args)
        auth = resolve_auth(file=args.secret_file)
        insecure = args.insecure_no_auth or insecure_from_env()
        check_bind(args.host, auth is not None, insecure, "kvbridge serve")
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"kvbridge serve: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # UCX would take SIGHUP for its debug handler when the NIXL agent starts, replacing
    # ours: kvbridge.backends sets UCX_DEBUG_SIGNO=0 on import, unless the user set it.
    signal.signal(signal.SIGTERM, _stop)
    # a closed terminal stops the engine cleanly; nohup's ignored SIGHUP stays ignored
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _stop)
    try:
        serve(config, host=args.host, port=control_port,
              ready_stream=_Announce(args, control_port),
              allow_shutdown=args.allow_remote_shutdown or is_loopback(args.host),
              exit_with_parent=False, auth=auth, insecure_no_auth=insecure)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print("kvbridge serve: stopped", file=sys.stderr)
    except ConfigError as exc:  # found as the engine starts: memory, a port in use
        print(f"kvbridge serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _check_ports(side_port: int, control_port: int) -> None:
    for field, port in (("port", side_port), ("control_port", control_port)):
        if not 1 <= port <= 65535:
            raise ConfigError(field, f"expected a TCP port in 1..65535, got {port}")
    if side_port == control_port:
        raise ConfigError("control_port", f"{control_port} is also the side-channel --port; "
                                          f"give each its own port")
