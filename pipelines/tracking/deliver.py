"""`python -m pipelines.tracking.deliver FOLDER [TRACKING_URI]`: deliver what a run's rank 0 and driver could not (the
store away past `tracking.flush_timeout_s` at the run's end), from the folder the run's last line named, in order,
the run's status last. Exit 0 when everything is delivered, 1 when the store still does not answer (nothing lost:
the calls stay in FOLDER), 2 on a usage error."""
from __future__ import annotations

import sys

from pipelines.tracking.outbox import COMMAND, deliver_kept


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(f"usage: {COMMAND} FOLDER [TRACKING_URI]", file=sys.stderr)
        return 2
    report = deliver_kept(argv[0], argv[1] if len(argv) > 1 else None)
    if report.kept_in:
        print(f"{report.pending} calls still not delivered (the store did not answer); they stay in {argv[0]}")
        return 1
    print(f"every kept call delivered from {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
