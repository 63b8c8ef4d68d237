"""`python -m pipelines.tracking.deliver FOLDER [TRACKING_URI]`: deliver what a run's rank 0 and driver could not (the
store away past `tracking.flush_timeout_s` at the run's end), from the folder the run's last line named, in order,
the run's status last. Exit 0 when everything deliverable is delivered (the calls the store refused stay listed in
FOLDER/refused.jsonl, never retried), 1 when the store still does not answer (nothing lost: the calls stay in FOLDER),
2 on a usage error."""
from __future__ import annotations

import sys

from pipelines.tracking.outbox import COMMAND, REFUSED_FILE, deliver_kept
from pipelines.tracking.store import hide_credentials


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(f"usage: {COMMAND} FOLDER [TRACKING_URI]", file=sys.stderr)
        return 2
    folder = hide_credentials(argv[0])
    try:
        report = deliver_kept(argv[0], argv[1] if len(argv) > 1 else None)
    except ValueError as err:  # no kept calls of a run there, and no store named
        print(hide_credentials(str(err)), file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - FOLDER's storage away: nothing was lost, the calls stay there
        print(f"could not deliver from {folder} ({hide_credentials(f'{type(err).__name__}: {err}')}); the calls stay "
              "there", file=sys.stderr)
        return 1
    refused = (f"; {report.refused} call{'s' * (report.refused != 1)} that the store refused: listed in "
               f"{folder}/{REFUSED_FILE}, not retried") if report.refused else ""
    if report.kept_in:
        print(f"{report.pending} calls still not delivered (the store did not answer); they stay in {folder}{refused}")
        return 1
    print(f"every deliverable kept call delivered from {folder}{refused}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
