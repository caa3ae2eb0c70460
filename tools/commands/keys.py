"""`kvbridge keys`: the store key namespaces a lookup checks for one engine topology."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from kvbridge.layouts import (
    KeyNamespace,
    LayoutError,
    load_spec,
    lookup_namespaces,
    preset_names,
    write_targets,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import add_topology_arguments, topology_from_args

KEYS_DIMS = ("tp", "dcp", "pp", "pcp")  # the order of its per-size flags in --help and errors

EPILOG = f"""\
MODEL is a preset ({", ".join(preset_names())}) or a spec JSON file.
A block is in the store only if every listed namespace holds its key
(namespace + ':' + block hash). Ranks holding identical bytes share one
namespace; its writer is the rank named by the namespace's tp rank.

examples:
  kvbridge keys --model tiny-gqa --tp 4
  kvbridge keys --model tiny-hybrid --tp 4 --dcp 2 --pp 2 --json
  kvbridge keys --model tiny-hybrid --topology tp=4,dcp=2,pp=2   # same, as `serve` takes it

--json prints {{"model", "fingerprint", "topology", "count", "namespaces":
[{{"namespace", ..., "writer_tp_rank", "held_by_tp_ranks", "tokens_per_key"}}]}}.

exit codes: 0 ok, 1 the model cannot run on this topology (reason on stderr), 2 usage error
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keys", help="list the store key namespaces a lookup must check",
        description="List every key namespace holding a part of a block for a model on one "
                    "engine topology, with the ranks sharing each and its designated writer.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="PRESET|FILE",
                        help="model preset name or spec JSON file")
    add_topology_arguments(parser, KEYS_DIMS)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.model)
        sizes = topology_from_args(args, KEYS_DIMS)
    except LayoutError as exc:
        print(f"kvbridge keys: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        namespaces = lookup_namespaces(spec, sizes)
    except LayoutError as exc:
        print(f"kvbridge keys: refused: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    held_by: dict[KeyNamespace, list[int]] = defaultdict(list)
    tokens: dict[KeyNamespace, int] = {}
    for rank in sizes.ranks():
        for target in write_targets(spec, rank):
            held_by[target.namespace].append(rank.tp_rank)
            tokens[target.namespace] = target.tokens_per_key
    entries: list[dict[str, Any]] = []
    for ns in namespaces:
        entry = ns.to_dict()
        entry["writer_tp_rank"] = ns.tp_rank
        entry["held_by_tp_ranks"] = held_by[ns]
        entry["tokens_per_key"] = tokens[ns]
        entries.append(entry)
    if args.json:
        print(json.dumps({"model": spec.model, "fingerprint": spec.fingerprint(),
                          "topology": sizes.describe(), "count": len(entries),
                          "namespaces": entries}, indent=2))
        return EXIT_OK
    print(f"model {spec.model} (layout {spec.fingerprint()}) on {sizes.describe()}: "
          f"{len(entries)} namespaces per block")
    for entry in entries:
        ranks = entry["held_by_tp_ranks"]
        shared = f"held by tp {','.join(map(str, ranks))}" if len(ranks) > 1 else "own"
        print(f"  {entry['namespace']}  tokens/key {entry['tokens_per_key']}  {shared}")
    return EXIT_OK
