"""A download's summary: every unique URL counted once, as written or under its failure reason.

Counts come from the per-shard ``_stats.json`` of every finished shard (img2dataset's ``status_dict``)
plus this run's failed parts, so a summary after a re-run covers the whole output folder.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from pipelines.download.config import DownloadConfig
from pipelines.download.shard import PartResult, shard_done, shard_name
from pipelines.storage import fs_path, read_json


def summarize_download(cfg: DownloadConfig, manifest: dict, results: list[PartResult], skipped: int,
              seconds: float) -> dict[str, Any]:
    fs, out = fs_path(cfg.output)
    reasons: Counter = Counter()
    written = complete = 0
    failed_parts = {r.shard: r for r in results if not r.ok}
    finished = set()  # shards in place, whatever their part reported (a part can fail after moving its shard there)
    for part in manifest["parts"]:
        name = shard_name(part["shard"], manifest["shard_digits"])
        stats = read_json(fs, f"{out}/{name}_stats.json") if shard_done(fs, out, name) else None
        if stats is None:
            r = failed_parts.get(part["shard"])
            reasons[f"part failed: {r.error}" if r else "not downloaded yet"] += part["rows"]
            continue
        finished.add(part["shard"])
        complete += 1
        written += int(stats.get("successes", 0))
        for reason, n in (stats.get("status_dict") or {}).items():
            if reason != "success":
                reasons[reason] += int(n)
    this_run = sum(int(r.stats.get("count", 0)) for r in results if r.ok)
    written_this_run = sum(int(r.stats.get("successes", 0)) for r in results if r.ok)
    unique = sum(p["rows"] for p in manifest["parts"])
    return {
        "input": cfg.input,
        "output": cfg.output,
        "input_rows": manifest["input_rows"],
        "duplicates_removed": manifest["duplicates_removed"],
        "missing_url": manifest["missing_url"],
        "unique_urls": unique,
        "written": written,
        "failed": unique - written,
        "failed_by_reason": dict(reasons.most_common()),
        "captions_repaired": manifest["captions_repaired"],
        "empty_captions": manifest["empty_captions"],
        "shards": len(manifest["parts"]),
        "shards_complete": complete,
        "shards_skipped": skipped,
        "shards_downloaded": sum(r.shard in finished for r in results),
        "shards_failed": sum(r.shard not in finished for r in results),
        "urls_fetched_this_run": this_run,
        "written_this_run": written_this_run,
        # node id -> the shards its tasks downloaded this run (a cluster spreads the parts over its nodes)
        "parts_by_node": _parts_by_node(results, manifest["shard_digits"]),
        "seconds": round(seconds, 3),
        "images_per_s": round(written_this_run / seconds, 2) if seconds > 0 else 0.0,
    }


def _parts_by_node(results: list[PartResult], digits: int) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for r in sorted(results, key=lambda r: r.shard):
        if r.node:
            by_node.setdefault(r.node, []).append(shard_name(r.shard, digits))
    return by_node


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"download summary for {s['output']}",
        f"  input rows {s['input_rows']}, duplicates removed {s['duplicates_removed']}, "
        f"rows without URL {s['missing_url']}, unique URLs {s['unique_urls']}",
        f"  written {s['written']}, failed {s['failed']}",
    ]
    lines += [f"    {n:>8}  {reason}" for reason, n in s["failed_by_reason"].items()]
    lines.append(f"  shards {s['shards_complete']}/{s['shards']} complete (this run: {s['shards_downloaded']} "
                 f"downloaded, {s['shards_skipped']} already finished, {s['shards_failed']} failed)")
    if s.get("parts_by_node"):
        lines.append(f"  downloaded this run by {len(s['parts_by_node'])} node(s):")
        lines += [f"    node {node}: shards {', '.join(shards)}" for node, shards in s["parts_by_node"].items()]
    lines.append(f"  captions repaired (not UTF-8) {s['captions_repaired']}, empty captions {s['empty_captions']}")
    lines.append(f"  {s['written_this_run']} images written this run in {s['seconds']:.1f}s "
                 f"({s['images_per_s']:.1f} images/s)")
    if s["shards_complete"] < s["shards"]:
        lines.append("  some shards are incomplete: run the same command again to finish them")
    return "\n".join(lines)
