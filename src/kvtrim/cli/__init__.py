"""The ``kvtrim`` command line: ``methods``, ``generate``, ``search-patterns``, ``demo``, ``chat``, ``stream``,
``eval``, ``report``, ``calibrate``, ``bench``, ``models``, ``serve``.

This package's ``__init__`` holds the parser and :func:`main`; each command group is a module of
its own (:mod:`~kvtrim.cli.generate`, :mod:`~kvtrim.cli.batch`, :mod:`~kvtrim.cli.methods`,
:mod:`~kvtrim.cli.patterns`, :mod:`~kvtrim.cli.session`, :mod:`~kvtrim.cli.eval`,
:mod:`~kvtrim.cli.models`, :mod:`~kvtrim.cli.serve`), built on the shared helpers of :mod:`~kvtrim.cli.common`; none of
them imports this ``__init__``.

Errors in user input print one line ``kvtrim: error: ...`` naming the problem and what is
allowed, and exit with status 2; a value out of range is refused as the command line is parsed.
Every option's help shows its allowed values and default (:class:`~kvtrim.cli.common.HelpFormatter`).
A closed standard output (``kvtrim ... | head -1``) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import NoReturn

from kvtrim.cli.common import HelpFormatter, print_error
from kvtrim.cli.eval import add_eval_commands
from kvtrim.cli.generate import add_generate_command
from kvtrim.cli.methods import add_demo_command, add_methods_command
from kvtrim.cli.models import add_model_commands
from kvtrim.cli.patterns import add_search_patterns_command
from kvtrim.cli.serve import add_serve_command
from kvtrim.cli.session import add_session_commands
from kvtrim.errors import KVTrimError


def version() -> str:
    """The installed distribution's version, else the source tree's ``kvtrim.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvtrim")
    except PackageNotFoundError:
        from kvtrim import __version__

        return __version__


class Parser(argparse.ArgumentParser):
    """argparse with kvtrim's error contract: one line ``kvtrim: error: ...`` and exit status 2
    (argparse's own prints the usage first; sub-command parsers inherit this class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # every option's allowed values and default
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # a value refused by its type (kvtrim.cli.common's checkers): "--keep must be ..., got 1.5"
        message = re.sub(r"^argument ([-\w/]+): must be ", r"\1 must be ", message)
        self.exit(2, f"kvtrim: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvtrim", description="KV-cache compression for long-context inference.")
    p.add_argument("--version", action="version", version=f"kvtrim {version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", required=True)
    add_methods_command(sub)  # methods
    add_generate_command(sub)  # generate
    add_search_patterns_command(sub)  # search-patterns
    add_demo_command(sub)  # demo
    add_session_commands(sub)  # chat, stream
    add_eval_commands(sub)  # eval, report, calibrate, bench
    add_model_commands(sub)  # models
    add_serve_command(sub)  # serve
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # stdout's reader closed early (`kvtrim ... | head -1`): it has what it wanted, as with any Unix
        # tool. What is still buffered goes to /dev/null, so the flush at exit does not fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (captured)
            pass
        return 0


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, --version, a parse error: their output is flushed here, where a closed pipe is caught
        sys.stdout.flush()
        raise
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        rc = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that went away is a BrokenPipeError here, not at exit
        return rc
    except KVTrimError as e:
        print_error(str(e))
        return 2
    except KeyboardInterrupt:
        print("kvtrim: interrupted", file=sys.stderr)
        return 130
