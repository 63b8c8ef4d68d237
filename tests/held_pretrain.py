"""`jobs.pretrain` run with rank 0 held at points of the run until the test releases them (tests.helpers.Hold), for a
test that needs the job as a process of its own (signals to its process group, its own environment):

    python -m tests.held_pretrain FOLDER POINT [POINT ...] -- --config configs/demo.yaml --set ...

Each POINT (pipelines.fit.faults: final_evaluation, attempt_start, ...) talks through FOLDER as Hold does."""
from __future__ import annotations

import sys

from tests.helpers import Hold, holds_armed


def main(argv: list[str]) -> int:
    split = argv.index("--")
    folder, points = argv[0], argv[1:split]
    import jobs.pretrain

    with holds_armed(tuple(Hold(folder, point) for point in points)):
        return jobs.pretrain.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
