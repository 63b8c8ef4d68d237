"""What the readers skipped, by reason, kept in one small named Ray actor per cluster, and how it is reported.

Counts are keyed by the dataset's ``stats_name``. A skipped sample is counted each time it is met (once per epoch;
the share of samples skipped is taken over those occurrences) and once by its (file, key) (``skipped_unique``: how
many samples of the data are bad). A broken file (`pipelines.data.tars`) is kept by its path with its reason, the
samples read before its break and how many reads met it. Training readers send their counts without waiting for
them (no round trip per batch), so the counts of a read that just ended may arrive a moment after its data.

Reported: the training progress line (share skipped so far), MLflow (`report_metrics`: ``data/{dataset}/...``; the
examples as an artifact), the end-of-run summary and `jobs.evaluate` / `jobs.embed` (`report_lines`). The training
run stops past ``data.max_bad_frac`` (`bad_share_error`).
"""
from __future__ import annotations

import functools
import re

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipelines.compat.ray_private import head_node_ids
from pipelines.config import InputError

STATS_ACTOR, STATS_NAMESPACE = "probvlp_reader_stats", "probvlp"

# Why a reader drops a sample (`SkippedSample.reason`); broken files: pipelines.data.tars.FILE_REASONS.
SAMPLE_REASONS = ("no image", "undecodable image", "image too large", "unreadable json", "no caption",
                  "caption not UTF-8", "no class")
EXAMPLES = 5  # example samples kept in reports per reason


class SkippedSample(ValueError):
    """A sample a reader drops, with one of SAMPLE_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


class BadDataError(InputError):
    """More of the training data is bad than data.max_bad_frac allows (one line: share, main reason, example)."""


@functools.lru_cache(maxsize=None)
def _stats_actor_class():
    @ray.remote(num_cpus=0)
    class ReaderStats:
        """Decoded / skipped sample counts per dataset name, the skipped samples' (file, key) by reason (capped),
        and the broken files."""

        MAX_KEYS = 100_000

        def __init__(self):
            self.data: dict[str, dict] = {}

        def _of(self, name: str) -> dict:
            return self.data.setdefault(name, {"decoded": 0, "skipped": {}, "keys": {}, "files": {}})

        def add(self, name: str, decoded: int, skipped: list[tuple[str, str, str]] = ()) -> None:
            """`decoded` samples read, and the skipped ones as (reason, file, key)."""
            d = self._of(name)
            d["decoded"] += decoded
            for reason, url, key in skipped:
                d["skipped"][reason] = d["skipped"].get(reason, 0) + 1
                keys = d["keys"].setdefault(reason, set())
                if len(keys) < self.MAX_KEYS:
                    keys.add((str(url), str(key)))

        def add_file(self, name: str, path: str, reason: str, detail: str, kept: int) -> None:
            f = self._of(name)["files"].setdefault(path, {"reason": reason, "detail": detail, "kept": kept, "reads": 0})
            f["reads"] += 1

        def get(self, name: str, examples: int = EXAMPLES) -> dict:
            d = self.data.get(name) or {"decoded": 0, "skipped": {}, "keys": {}, "files": {}}
            return {"decoded": d["decoded"], "skipped": dict(d["skipped"]),
                    "skipped_unique": {r: len(k) for r, k in d["keys"].items()},
                    "examples": {r: [list(x) for x in sorted(k)[:examples]] for r, k in d["keys"].items()},
                    "files": {p: dict(f) for p, f in d["files"].items()}}

        def keys(self, name: str) -> dict[str, list[list[str]]]:
            """Every skipped sample's [file, key] by reason (up to MAX_KEYS per reason)."""
            d = self.data.get(name) or {"keys": {}}
            return {r: [list(x) for x in sorted(k)] for r, k in d["keys"].items()}

        def drop(self, name: str) -> None:
            self.data.pop(name, None)

    return ReaderStats


def stats_actor():
    """The cluster's `ReaderStats` actor (created on first use).

    Detached: a non-detached actor dies once the last handle to it is dropped (when a dataset is
    freed), and a later run in the same driver would get the dying actor by name. Created on the head node
    (whoever asks first, a driver or a Ray Train worker): an actor on a worker node keeps that node busy, so
    the autoscaler would never remove it, and dies with it. Restarted (empty) if its node is lost anyway, and
    its calls retried: losing a node must not fail the readers with it.
    """
    # Hard affinity: a soft one was seen to land (or restart) the actor on a worker node of the local cluster.
    heads = head_node_ids()
    here = NodeAffinitySchedulingStrategy(heads[0] if heads else ray.get_runtime_context().get_node_id(),
                                          soft=not heads)
    return _stats_actor_class().options(name=STATS_ACTOR, namespace=STATS_NAMESPACE, get_if_exists=True,
                                        lifetime="detached", scheduling_strategy=here, max_restarts=-1,
                                        max_task_retries=-1).remote()


def reader_stats(name: str, examples: int = EXAMPLES) -> dict:
    """{decoded, skipped, skipped_unique, examples, files} of a dataset read with this stats_name (see ReaderStats)."""
    return ray.get(stats_actor().get.remote(name, examples))


def skipped_keys(name: str) -> dict[str, list[list[str]]]:
    return ray.get(stats_actor().keys.remote(name))


def drop_stats(name: str) -> None:
    ray.get(stats_actor().drop.remote(name))


# ------------------------------------------------------------------------------------ reporting (plain dicts)


def slug(reason: str) -> str:
    """A reason as an MLflow metric name part: "caption not UTF-8" -> caption_not_utf_8."""
    return re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")


def skipped_share(st: dict) -> float:
    """Share of the samples met that were skipped (occurrences: each epoch counts its own)."""
    skipped = sum(st["skipped"].values())
    met = st["decoded"] + skipped
    return skipped / met if met else 0.0


def report_metrics(label: str, st: dict) -> dict[str, float]:
    """MLflow metrics of one dataset's stats: data/{label}/skipped_frac, skipped, skipped/{reason}, bad_files,
    bad_files/{reason} (distinct samples and files; reasons that occurred)."""
    p = f"data/{label}"
    out = {f"{p}/skipped_frac": skipped_share(st), f"{p}/skipped": float(sum(st["skipped_unique"].values())),
           f"{p}/bad_files": float(len(st["files"]))}
    out.update({f"{p}/skipped/{slug(r)}": float(n) for r, n in st["skipped_unique"].items()})
    for f in st["files"].values():
        out[f"{p}/bad_files/{slug(f['reason'])}"] = out.get(f"{p}/bad_files/{slug(f['reason'])}", 0.0) + 1
    return out


def _example(ref: list[str]) -> str:
    url, key = ref
    return f"{key.rsplit('/', 1)[-1]} ({url.rsplit('/', 1)[-1]})" if url else key


def report_lines(label: str, st: dict) -> list[str]:
    """What a reader skipped in one dataset, for people: the share, counts by reason with example keys (and their
    files), each broken file with its reason."""
    lines = []
    unique = st["skipped_unique"]
    if unique:
        total = sum(unique.values())
        lines.append(f"data ({label}): {total} sample{'s' * (total != 1)} skipped, {skipped_share(st):.1%} of those "
                     "read:")
        for reason, n in sorted(unique.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {reason}: {n}, e.g. {', '.join(_example(r) for r in st['examples'].get(reason, []))}")
    for path, f in sorted(st["files"].items()):
        kept = f", {f['kept']} samples before the break kept" if f["kept"] else ""
        lines.append(f"data ({label}): skipped file {path}: {f['reason']}{kept} ({f['detail']})")
    return lines


def reports_summary(reports: dict[str, dict]) -> list[str]:
    """report_lines of every dataset, or one line saying nothing was skipped."""
    lines = [line for label, st in reports.items() for line in report_lines(label, st)]
    return lines or [f"data: no sample or file skipped ({', '.join(reports)})"]


def bad_share_error(label: str, st: dict, max_frac: float, min_met: int) -> str | None:
    """The one line that stops a run whose share of skipped samples is past max_frac, once at least min_met
    samples were met (a few bad samples at the start do not decide); None while within the limit."""
    skipped = sum(st["skipped"].values())
    if st["decoded"] + skipped < min_met or skipped_share(st) <= max_frac:
        return None
    main = max(st["skipped"], key=st["skipped"].get)
    example = st["examples"].get(main, [["", "?"]])[0]
    where = f"{example[0]} (sample {example[1].rsplit('/', 1)[-1]})" if example[0] else f"sample {example[1]}"
    return (f"{label} data: {skipped_share(st):.1%} of the samples read were skipped, over data.max_bad_frac "
            f"{max_frac:g}; mostly {main} ({st['skipped'][main]}), e.g. {where}")
