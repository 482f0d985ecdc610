"""What every varuna command line shares: usage errors are one line and exit 2.

    >>> parser = OneLineParser(prog="varuna-demo")
    >>> _ = parser.add_argument("--steps", type=int)
    >>> parser.parse_args(["--steps", "3"]).steps
    3
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["EXIT_USAGE", "OneLineParser"]

#: Exit status of a command-line usage error (argparse's own convention).
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line naming the command and
    pointing at ``--help`` (the contract of every varuna CLI), instead of the usage block."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
