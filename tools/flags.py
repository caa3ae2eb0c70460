"""Argument helpers shared by several ``kvbridge`` subcommands.

A command group (``kvbridge events``, ``kvbridge offload``, ...) run without
its subcommand prints its help to stderr and exits with the usage-error code
(:func:`require_subcommand`).

One engine topology is given either all at once (``--topology tp=4,dcp=2``,
as ``kvbridge serve`` and ``kvbridge demo`` take it) or one size per flag
(``--tp 4 --dcp 2``); giving both is a usage error that names the flags, so
a command never silently prefers one over the other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvbridge.layouts import LayoutError, ParallelTopology
from kvbridge.tools.cli import EXIT_USAGE

TOPOLOGY_DIMS = ("tp", "pp", "dcp", "pcp")


def add_topology_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                           dims: Sequence[str] = TOPOLOGY_DIMS) -> None:
    """``--topology`` and one ``--<dim>`` per size; ``dims`` orders the flags in ``--help``."""
    parser.add_argument("--topology", default=None, metavar="TOPOLOGY",
                        help=f"all sizes at once, e.g. tp=4,dcp=2 (instead of "
                             f"{'/'.join(f'--{d}' for d in dims[:2])}/...)")
    for dim in dims:
        parser.add_argument(f"--{dim}", type=int, default=None, metavar="N",
                            help=f"{dim} size (default 1)")


def topology_from_args(args: argparse.Namespace,
                       dims: Sequence[str] = TOPOLOGY_DIMS) -> ParallelTopology:
    """The topology of :func:`add_topology_arguments`' flags (sizes not given are 1).

    Raises :class:`LayoutError` (field ``topology``) when both forms are given, and
    naming the flag (``--tp``) for a size out of range (``--tp 0`` is refused, not 1).
    """
    sizes = {d: getattr(args, d) for d in dims}
    if args.topology is not None:
        given = [f"--{d}" for d, v in sizes.items() if v is not None]
        if given:
            raise LayoutError("topology", f"give --topology or {', '.join(given)}, not both")
        return ParallelTopology.parse(args.topology, "topology")
    try:  # a size given as 0 reaches the topology's check (it never becomes 1)
        return ParallelTopology(**{f"{d}_size": 1 if v is None else v for d, v in sizes.items()})
    except LayoutError as exc:  # name the flag: tp_size -> --tp
        flag = exc.field.removesuffix("_size")
        raise LayoutError(f"--{flag}" if flag in sizes else exc.field, exc.reason) from None


def require_subcommand(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (a command group) print its help and return EXIT_USAGE when run bare."""

    def usage(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return EXIT_USAGE

    parser.set_defaults(func=usage)


DEVICE_HELP = ("where each engine rank's KV cache lives: cpu (default), cuda (rank r on "
               "cuda:(r mod number of GPUs)) or cuda:N (every rank on GPU N)")


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device cpu|cuda|cuda:N``: the engines' ``device`` setting."""
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N", help=DEVICE_HELP)


def device_from_args(args: argparse.Namespace) -> str:
    """The checked ``--device`` (a :class:`ConfigError` naming ``device`` for a bad value or
    a CUDA device this host lacks): checked before any engine process starts."""
    from kvbridge.engine.devices import check_device, parse_device  # imports torch

    device = parse_device(getattr(args, "device", "cpu") or "cpu")
    check_device(device)
    return device
