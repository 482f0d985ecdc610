"""The ``varuna-manager`` console script: checks the manager extra before the CLI is imported.

:mod:`manager.cli` (and everything it imports) needs grpc and protobuf, which the core install
does not have; importing it there would end in a traceback. This entry point imports nothing of
the manager until the extra is known to be installed, and otherwise prints one line::

    $ varuna-manager status
    varuna-manager needs the manager extra (grpc, protobuf): pip install 'varuna[manager]'
    $ echo $?
    2
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from varuna.core.cli import EXIT_USAGE
from varuna.core.extras import MissingExtra, require_extra

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``varuna-manager`` (:func:`manager.cli.main`) if grpc and protobuf are installed."""
    try:
        require_extra("manager", "varuna-manager", ["grpc", "google.protobuf"])
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    from manager.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
