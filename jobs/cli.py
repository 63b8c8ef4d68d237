"""What the entry points share: `--config` / `--set` arguments, and a ConfigError as one line and exit status 2."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from pipelines.config import ConfigError
from pipelines.evaluate.tasks import EvaluationError


def config_parser(prog: str, doc: str, config_help: str, set_example: str) -> argparse.ArgumentParser:
    """A parser with the job's description (the docstring's first line), `--config FILE` and repeatable `--set`."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.splitlines()[0])
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config value, e.g. --set {set_example} (repeatable)")
    return parser


def exits_2_on_config_error(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a job's main: a ConfigError anywhere (loading, or data checked later) prints `config error: ...`
    to stderr and returns exit status 2; an EvaluationError (the model trained and saved, a task failed)
    prints `evaluation error: ...` and returns 1."""
    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        except EvaluationError as err:  # the model is saved; the message says where
            print(f"evaluation error: {err}", file=sys.stderr)
            return 1

    return wrapped
