"""What the entry points share: their argument parsers, and how an error ends a job (one line, an exit status)."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from pipelines.config import ConfigError, InputError, RunStopped
from pipelines.evaluate import EvaluationError
from pipelines.gc_tuning import collect_less


def job_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser for `python -m {prog}` described by the job's docstring's first line."""
    return argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.splitlines()[0])


class _Override(argparse.Action):
    """`--set KEY=VALUE`, appended; a value that carries credentials (a URI's password or token) gets one warning:
    a command line is seen by every user of the machine and Ray keeps a driver's (its dashboard's jobs)."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), value])
        if "@" in value or "?" in value:  # before loading MLflow's package for the check
            from pipelines.tracking.store import hide_credentials

            if hide_credentials(value) != value:
                print(f"warning: --set {hide_credentials(value)} carries credentials, and a command line is seen by "
                      "every user of this machine (ps) and kept by Ray (its dashboard's jobs): put them in the config "
                      "file or the environment (MLFLOW_TRACKING_URI)", file=sys.stderr)


def config_parser(prog: str, doc: str, config_help: str, set_example: str) -> argparse.ArgumentParser:
    """A job parser with `--config FILE` and repeatable `--set KEY=VALUE`."""
    parser = job_parser(prog, doc)
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--set", dest="overrides", action=_Override, default=[], metavar="KEY=VALUE",
                        help=f"override a config value, e.g. --set {set_example} (repeatable)")
    return parser


def job_main(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a job's main: a ConfigError anywhere (loading, or data checked later) prints `config error: ...`
    to stderr and returns exit status 2; an InputError (a model or data named on the command line or in the
    config) prints `error: ...` and returns 2; an EvaluationError (the model trained and saved, a task failed)
    prints `evaluation error: ...` and returns 1; a RunStopped (notices that never clear) prints `stopped: ...` and
    returns 1."""
    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        collect_less()  # before the job's deferred imports (torch, Ray, MLflow)
        try:
            return main(argv)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except EvaluationError as err:  # the model is saved; the message says where
            print(f"evaluation error: {err}", file=sys.stderr)
            return 1
        except RunStopped as err:
            print(f"stopped: {err}", file=sys.stderr)
            return 1

    return wrapped
