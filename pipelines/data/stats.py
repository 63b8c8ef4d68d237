"""Decoded and corrupt sample counts of the reader, kept in one small named Ray actor per cluster.

Counts are keyed by the dataset's ``stats_name``. A corrupt sample is counted each time it is met
(once per epoch); ``corrupt_unique`` counts distinct keys. Reader tasks send their counts without waiting for
them (no round trip per batch), so the counts of a read that just ended may arrive a moment after its data.
"""
from __future__ import annotations

import functools

STATS_ACTOR, STATS_NAMESPACE = "probvlp_reader_stats", "probvlp"


@functools.lru_cache(maxsize=None)
def _stats_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class ReaderStats:
        """Decoded / corrupt sample counts per dataset name, and a capped set of corrupt keys."""

        MAX_KEYS = 100_000

        def __init__(self):
            self.counts: dict[str, dict[str, int]] = {}
            self.keys: dict[str, set] = {}

        def add(self, name: str, decoded: int, corrupt_keys: list[str]) -> None:
            c = self.counts.setdefault(name, {"decoded": 0, "corrupt": 0})
            c["decoded"] += decoded
            c["corrupt"] += len(corrupt_keys)
            keys = self.keys.setdefault(name, set())
            for key in corrupt_keys:
                if len(keys) < self.MAX_KEYS:
                    keys.add(key)

        def get(self, name: str) -> dict:
            c = dict(self.counts.get(name, {"decoded": 0, "corrupt": 0}))
            c["corrupt_unique"] = len(self.keys.get(name, ()))
            c["corrupt_examples"] = sorted(self.keys.get(name, ()))[:20]
            return c

    return ReaderStats


def stats_actor():
    """The cluster's `ReaderStats` actor (created on first use).

    Detached: a non-detached actor dies once the last handle to it is dropped (when a dataset is
    freed), and a later run in the same driver would get the dying actor by name. Created on the head node
    (whoever asks first, a driver or a Ray Train worker): an actor on a worker node keeps that node busy, so
    the autoscaler would never remove it, and dies with it. Restarted (empty) if its node is lost anyway, and
    its calls retried: losing a node must not fail the readers with it.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Hard affinity: a soft one was seen to land (or restart) the actor on a worker node of the local cluster.
    heads = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    here = NodeAffinitySchedulingStrategy(heads[0] if heads else ray.get_runtime_context().get_node_id(),
                                          soft=not heads)
    return _stats_actor_class().options(name=STATS_ACTOR, namespace=STATS_NAMESPACE, get_if_exists=True,
                                        lifetime="detached", scheduling_strategy=here, max_restarts=-1,
                                        max_task_retries=-1).remote()


def reader_stats(name: str) -> dict:
    """{decoded, corrupt, corrupt_unique, corrupt_examples} for a dataset read with this stats_name."""
    import ray

    return ray.get(stats_actor().get.remote(name))
