"""`kvbridge serve`: run one engine (producer or consumer) with the NIXL connector until interrupted.

This is how an operator checks a real link between two machines: on host A
``kvbridge serve --role producer --host A --port 5600`` (side channel on 5600,
engine control on 5601), on host B ``kvbridge demo --producer-addr A:5600``
(only the consumer runs there); ``kvbridge probe A:5600`` shows the metadata.
The control socket accepts the msgpack protocol of :mod:`kvbridge.engine.server`
from any client: firewall it (and the NIXL/UCX ports) to the peers you trust.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import TYPE_CHECKING, Any

from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole
from kvbridge.layouts import LayoutError, ParallelTopology, load_spec, preset_names
from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from kvbridge.engine.core import EngineConfig

EPILOG = """\
examples:
  kvbridge serve --role producer --host 10.0.0.5 --port 5600
  kvbridge serve --role producer --model tiny-hybrid --tp 2 --mode push --port 5600 --json
  # then, on another machine:
  kvbridge demo --producer-addr 10.0.0.5:5600 --consumer tp=1
  kvbridge probe 10.0.0.5:5600

--json prints one ready line {"role", "mode", "model", "engine_id", "side_channel",
"control"} once the engine listens.

exit codes: 0 stopped by a signal or a shutdown request, 2 usage error
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
    parser.add_argument("--topology", default=None, metavar="tp=..,pp=..",
                        help="parallel sizes (default tp=1); or use --tp/--pp")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=256, metavar="N")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on and to advertise (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=5600, help="side-channel port (default 5600)")
    parser.add_argument("--control-port", type=int, default=None,
                        help="engine control port (default PORT+1)")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--kv-config", metavar="JSON", help="extra connector settings")
    parser.add_argument("--json", action="store_true", help="print the ready line as JSON")
    from kvbridge.tools.events_flags import add_events_arguments, with_engine_events

    add_events_arguments(parser)  # --events-endpoint / --events-replay-endpoint
    parser.set_defaults(func=with_engine_events(run))


def build_config(args: argparse.Namespace) -> EngineConfig:
    from kvbridge.engine.core import EngineConfig  # imports torch: only when serving

    if args.topology is not None:
        topology = ParallelTopology.parse(args.topology)
    else:
        topology = ParallelTopology(tp_size=args.tp or 1, pp_size=args.pp or 1)
    extra: dict[str, Any] = json.loads(args.kv_config) if args.kv_config else {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_config", "expected a JSON object")
    extra.update({"mode": args.mode, "host": args.host, "port": args.port})
    role = KVRole.PRODUCER if args.role == "producer" else KVRole.CONSUMER
    connector = ConnectorConfig.from_dict({"kv_connector": "nixl", "kv_role": role.value,
                                           "engine_id": args.engine_id,
                                           "kv_connector_extra_config": extra})
    return EngineConfig(spec=load_spec(args.model), topology=topology,
                        num_blocks=args.num_blocks, max_num_batched_tokens=4096,
                        max_num_seqs=64, connector=connector)


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

    try:
        config = build_config(args)
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"kvbridge serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    control_port = args.control_port or args.port + 1

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        serve(config, host=args.host, port=control_port,
              ready_stream=_Announce(args, control_port))
    except KeyboardInterrupt:
        print("kvbridge serve: stopped", file=sys.stderr)
    return EXIT_OK
