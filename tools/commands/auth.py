"""`kvbridge auth`: make a cluster secret, and show which one this host would use.

The secret (:mod:`kvbridge.auth`) authenticates the side channel, the control
port, the events replay socket and NIXL peers' hellos. Make one once, copy the
file to every host of the cluster (mode 0600), and point each engine at it
(``KVBRIDGE_SECRET_FILE``, the connector's ``auth_secret_file``, or
``kvbridge serve --secret-file``). ``kvbridge auth show`` prints where the
secret comes from and its fingerprint, never the secret: equal fingerprints on
two hosts mean the same secret.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvbridge.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    Secret,
    SecretError,
    new_secret,
    resolve_secret,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

EPILOG = f"""\
examples:
  kvbridge auth new-secret --out /etc/kvbridge/cluster.secret
  {SECRET_FILE_ENV}=/etc/kvbridge/cluster.secret kvbridge auth show
  kvbridge auth show --secret-file /etc/kvbridge/cluster.secret --json
  kvbridge auth new-secret --json               # {{"secret": "..."}}

exit codes: 0 done, 1 no secret configured (show), 2 usage error (a file that
exists, a secret too short or unreadable)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "auth", help="make a cluster secret; show which one this host uses",
        description="Make the cluster secret that authenticates kvbridge's sockets, or show "
                    f"which secret this host would use ({SECRET_FILE_ENV}, {SECRET_ENV}, "
                    "--secret-file) by its fingerprint.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="auth_command", required=True)
    make = sub.add_parser("new-secret", help="print or write a fresh random secret",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    make.add_argument("--out", metavar="FILE", default=None,
                      help="write it there (mode 0600; refuses an existing file) instead of "
                           "printing it")
    make.add_argument("--json", action="store_true",
                      help='{"secret"} (printed) or {"written", "fingerprint"} (--out)')
    make.set_defaults(func=_new)
    show = sub.add_parser("show", help="where this host's secret comes from, and its "
                                       "fingerprint",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("--secret-file", metavar="FILE", default=None,
                      help=f"this file instead of {SECRET_FILE_ENV} / {SECRET_ENV}")
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.set_defaults(func=_show)


def _new(args: argparse.Namespace) -> int:
    if args.out is None:
        value = new_secret()
        print(json.dumps({"secret": value}) if args.json else value)
        return EXIT_OK
    try:
        value = new_secret(args.out)
    except OSError as exc:
        print(f"kvbridge auth new-secret: {args.out}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    fingerprint = Secret.from_value(value).fingerprint
    if args.json:
        print(json.dumps({"written": args.out, "fingerprint": fingerprint}))
    else:
        print(f"kvbridge auth: wrote a new secret to {args.out} (mode 0600), fingerprint "
              f"{fingerprint}", file=sys.stderr)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    try:
        secret = resolve_secret(file=args.secret_file)
    except SecretError as exc:
        print(f"kvbridge auth show: {exc}", file=sys.stderr)
        return EXIT_USAGE
    info = ({"configured": False} if secret is None else
            {"configured": True, "source": secret.source, "fingerprint": secret.fingerprint})
    if args.json:
        print(json.dumps(info))
    elif secret is None:
        print(f"no cluster secret configured ({SECRET_FILE_ENV}, {SECRET_ENV}): engines "
              "serve loopback only, unauthenticated")
    else:
        print(f"cluster secret from {secret.source}, fingerprint {secret.fingerprint}")
    return EXIT_OK if secret is not None else EXIT_FAILURE
