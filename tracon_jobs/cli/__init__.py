"""The `tracon-jobs` command: `main` parses the command line, runs one command and turns its
failures into exit codes (a stdout closed early among them); the commands live in the modules
of this package."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tracon_jobs import logs
from tracon_jobs.cli.context import CommandError
from tracon_jobs.cli.parser import Handler, build_parser
from tracon_jobs.errors import ConfigurationError

__all__ = ["main"]


EXIT_BROKEN_PIPE = 141
"""The exit code when the reader of stdout closed it early (`runs show ID | head`): 128 +
SIGPIPE, what a shell reports for `cat` or `git log` stopped the same way."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command of `argv`; its exit code. A closed stdout ends any command quietly
    (`EXIT_BROKEN_PIPE`), without the traceback of each `print` that could not be written."""
    try:
        try:
            return run_command(argv)
        finally:
            sys.stdout.flush()  # a short output is written here, and may find the pipe closed
    except BrokenPipeError:
        # the interpreter flushes stdout once more on its way out: let that write go nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def run_command(argv: Sequence[str] | None) -> int:
    importable_working_directory()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRACON_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logs.install()
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return handler(args, rest)
    except ConfigurationError as exc:
        print(f"tracon-jobs: {exc}", file=sys.stderr)
        return 78  # EX_CONFIG
    except CommandError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # a Ctrl-C of a command that follows something (`runs tail`)


def importable_working_directory() -> None:
    """Put the working directory first on `sys.path`, as `python -m` does, so `ToolModules`
    and `WorkflowModules` may name modules of the user's own folder (`myapp.tools`) whether
    the command runs as `tracon-jobs` (whose path starts at the script's folder) or not."""
    cwd = os.getcwd()
    if sys.path and sys.path[0] in ("", cwd):
        return
    sys.path.insert(0, cwd)
