"""``--events-endpoint`` / ``--events-replay-endpoint`` for commands that run engines.

``kvbridge demo`` and ``kvbridge serve`` publish their engines' KV events
(block pool as medium GPU, and every connector and tier) on the vLLM wire
format, so ``kvbridge events tail``, vLLM's example subscriber, llm-d's indexer
or Dynamo's router can follow them. Each engine has its own publisher (one
sequence per stream): the ``i``-th engine a command starts binds the endpoint's
port + ``i`` (vLLM's offset for data-parallel ranks), the replay endpoint
likewise; port ``*`` binds free ports, printed as each engine starts.

A command adds the flags with :func:`add_events_arguments` and wraps its
``run`` with :func:`with_engine_events`; :func:`make_event_sink` serves code
that builds one in-process engine itself.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.tools.cli import EXIT_USAGE

if TYPE_CHECKING:  # the engine imports torch: only when a command runs (cheap --help)
    from kvbridge.engine.kv_events import EngineEventsConfig, PublishedEngine
    from kvbridge.events import EventSink

HELP_ENDPOINT = ("publish the engines' KV events (vLLM wire format) on a ZMQ PUB socket bound "
                 "here, e.g. tcp://127.0.0.1:5557; the i-th engine binds port+i; port * binds "
                 "free ports (printed on stderr)")
HELP_REPLAY = ("bind the replay ROUTER socket here (vLLM replay protocol; same per-engine "
               "offsets), e.g. tcp://127.0.0.1:5657; keep it more ports away from the events "
               "endpoint than the command starts engines")


def add_events_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV events")
    group.add_argument("--events-endpoint", metavar="ENDPOINT", default=None, help=HELP_ENDPOINT)
    group.add_argument("--events-replay-endpoint", metavar="ENDPOINT", default=None,
                       help=HELP_REPLAY)


def events_config(args: argparse.Namespace) -> EngineEventsConfig | None:
    """The flags as a config (None without ``--events-endpoint``); ConfigError when invalid."""
    from kvbridge.connectors import ConfigError
    from kvbridge.engine.kv_events import EngineEventsConfig

    endpoint = getattr(args, "events_endpoint", None)
    replay = getattr(args, "events_replay_endpoint", None)
    if endpoint is None:
        if replay is not None:
            raise ConfigError("events_replay_endpoint", "needs --events-endpoint as well")
        return None
    return EngineEventsConfig(endpoint=endpoint, replay_endpoint=replay)


def make_event_sink(args: argparse.Namespace) -> EventSink | None:
    """A ``KVEventPublisher`` bound where the flags say (the caller closes it), or None."""
    config = events_config(args)
    return config.make_publisher() if config is not None else None


def _announce(command: str) -> Callable[[PublishedEngine], None]:
    def announce(engine: PublishedEngine) -> None:
        replay = f", replay {engine.replay_endpoint}" if engine.replay_endpoint else ""
        # \r and erase-line: a progress line may be on the terminal's last line
        sys.stderr.write(f"\r[{command}] KV events of {engine.name} {engine.engine_id}: "
                         f"{engine.endpoint}{replay}\033[K\n")
        sys.stderr.flush()
    return announce


def with_engine_events(run: Callable[[argparse.Namespace], int],
                       ) -> Callable[[argparse.Namespace], int]:
    """``run`` with every engine it starts (in this process or as an engine process)
    publishing its KV events where the flags say; exit code 2 for invalid flags."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        from kvbridge.connectors import ConfigError
        from kvbridge.engine.kv_events import publish_engine_events

        command = getattr(args, "command", None) or "kvbridge"
        try:
            config = events_config(args)
        except ConfigError as exc:
            print(f"kvbridge {command}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if config is None:
            return run(args)
        with publish_engine_events(config) as publishing:
            publishing.on_record = _announce(command)
            try:
                return run(args)
            except ConfigError as exc:  # an endpoint collision found as engines start
                print(f"kvbridge {command}: {exc}", file=sys.stderr)
                return EXIT_USAGE

    return wrapped
