"""jobs.download against a real http.server on 127.0.0.1, real img2dataset, real Ray.

One URL table holds valid images, duplicate URLs, 404s, a non-image body, a truncated JPEG, a
6000x6000 image, an empty caption and a non-UTF-8 caption. The server counts every request.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from pipelines.download.config import DownloadConfig, load_download_config
from pipelines.download.job import download_shards
from pipelines.download.plan import plan
from pipelines.download.shard import shard_name
from pipelines.cluster.file_server import LoopbackServer
from pipelines.download.urls import DownloadError
from tests.helpers import jpeg
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
IMAGE_SIZE = 32
REASON_404 = "HTTP Error 404: File not found"
REASON_DECODE = "Image decoding error"


def shard_tars(output: str | Path) -> list[Path]:
    """The finished shards' .tar files (those with img2dataset's _stats.json beside them)."""
    return sorted(p for p in Path(output).glob("*.tar") if p.with_name(f"{p.stem}_stats.json").exists())


def read_samples(output: Path) -> dict[str, dict]:
    """key -> {url, txt, jpg sha, meta} over all finished shards."""
    samples = {}
    for path in shard_tars(str(output)):
        with tarfile.open(path) as tar:
            files: dict[str, dict] = {}
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                files.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for key, f in files.items():
            meta = json.loads(f["json"])
            assert key not in samples, f"key {key} in two shards"
            samples[key] = {"url": meta["url"], "txt": f["txt"].decode(), "sha": hashlib.sha256(f["jpg"]).hexdigest(),
                            "meta": meta, "jpg": f["jpg"]}
    return samples


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Files to serve, and a server on an ephemeral loopback port."""
    folder = tmp_path_factory.mktemp("site")
    for i in range(12):
        (folder / f"ok{i}.jpg").write_bytes(jpeg(i))
    (folder / "page.jpg").write_bytes(b"<html><body>this is not an image</body></html>")
    (folder / "truncated.jpg").write_bytes(jpeg(99, (200, 200))[:300])
    buf = io.BytesIO()
    big = Image.new("RGB", (6000, 6000), (20, 120, 200))
    big.paste((250, 250, 0), (1000, 1000, 5000, 5000))
    big.save(buf, format="JPEG", quality=80)
    (folder / "huge.jpg").write_bytes(buf.getvalue())
    with LoopbackServer(folder) as server:
        yield folder, server


def url_table(site, path: Path) -> dict:
    """A TSV URL table (bytes: one caption is Latin-1, not UTF-8). Returns what it holds."""
    folder, server = site
    rows = [(server.url(f"ok{i}.jpg"), f"image number {i}".encode()) for i in range(12)]
    rows += [(server.url("ok0.jpg"), b"image number 0"),            # exact duplicate
             (server.url("ok1.jpg"), b"another caption for one"),   # same URL, other caption
             (server.url("ok2.jpg"), b"image number 2")]
    rows += [(server.url(f"missing{i}.jpg"), b"gone") for i in range(3)]
    rows += [(server.url("page.jpg"), b"an html page"), (server.url("truncated.jpg"), b"cut short"),
             (server.url("huge.jpg"), b"a very large picture"),
             (server.url("ok3.jpg") + "?v=empty", b""),                          # empty caption
             (server.url("ok4.jpg") + "?v=latin1", "caf\u00e9 au lait".encode("latin-1"))]  # not UTF-8
    with open(path, "wb") as f:
        f.write(b"link\ttext\n")
        for url, caption in rows:
            f.write(url.encode() + b"\t" + caption + b"\n")
    valid = {server.url(f"ok{i}.jpg") for i in range(12)} | {server.url("huge.jpg"), server.url("ok3.jpg") + "?v=empty",
                                                            server.url("ok4.jpg") + "?v=latin1"}
    return {"rows": len(rows), "duplicates": 3, "valid": valid, "unique": len({u for u, _ in rows})}


def config(table: Path, output: Path, **overrides) -> DownloadConfig:
    return DownloadConfig(input=str(table), output=str(output), url_col="link", caption_col="text",
                          image_size=IMAGE_SIZE, rows_per_shard=6, threads_per_task=4, retries=1, timeout=10,
                          disallowed_header_directives=[], **overrides)


@pytest.fixture(scope="module")
def downloaded(ray_local, site, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("download")
    table = url_table(site, tmp / "urls.tsv")
    cfg = config(tmp / "urls.tsv", tmp / "out", planner="ray_data")  # the cluster path, on purpose
    site[1].requests.clear()
    summary = download_shards(cfg, local_only=True)
    return cfg, table, summary, dict(site[1].requests)


def test_summary_counts_every_failure_by_reason(downloaded):
    cfg, table, summary, _ = downloaded
    assert summary["input_rows"] == table["rows"]
    assert summary["duplicates_removed"] == table["duplicates"]
    assert summary["unique_urls"] == table["unique"] == table["rows"] - table["duplicates"]
    assert summary["written"] == len(table["valid"])
    assert summary["failed_by_reason"] == {REASON_404: 3, REASON_DECODE: 2}  # html body + truncated jpeg
    assert summary["failed"] == 5 and summary["written"] + summary["failed"] == summary["unique_urls"]
    assert summary["captions_repaired"] == 1 and summary["empty_captions"] == 1
    assert summary["shards_complete"] == summary["shards"] == summary["shards_downloaded"] >= 3
    saved = json.loads((Path(cfg.output) / "_summary.json").read_text())
    assert saved == summary
    # img2dataset's per-shard stats are kept next to each shard
    stats = [json.loads(p.read_text()) for p in Path(cfg.output).glob("*_stats.json")]
    assert len(stats) == summary["shards"] and sum(s["successes"] for s in stats) == summary["written"]


def test_every_valid_sample_is_in_the_shards(downloaded):
    cfg, table, _, _ = downloaded
    samples = read_samples(Path(cfg.output))
    by_url = {s["url"]: s for s in samples.values()}
    assert set(by_url) == table["valid"] and len(samples) == len(table["valid"])
    for s in samples.values():
        img = Image.open(io.BytesIO(s["jpg"]))
        assert img.size == (IMAGE_SIZE, IMAGE_SIZE) and img.mode == "RGB"
    huge = next(s for u, s in by_url.items() if u.endswith("huge.jpg"))
    assert huge["meta"]["original_width"] == 6000 and huge["txt"] == "a very large picture"
    assert next(s for u, s in by_url.items() if u.endswith("?v=empty"))["txt"] == ""
    assert next(s for u, s in by_url.items() if u.endswith("?v=latin1"))["txt"] == "caf\ufffd au lait"
    # The duplicated URL with two captions keeps one of them (the first in sort order).
    assert next(s for u, s in by_url.items() if u.endswith("/ok1.jpg"))["txt"] == "another caption for one"


def test_duplicates_are_fetched_once(downloaded):
    cfg, table, _, requests = downloaded
    # every distinct URL that answered is asked for exactly once, duplicates included
    fetched = {path: n for path, n in requests.items() if not path.startswith("/missing")}
    assert all(n == 1 for n in fetched.values()), fetched
    assert {p for p in requests if p.startswith("/ok")} == {f"/ok{i}.jpg" for i in range(12)} | {
        "/ok3.jpg?v=empty", "/ok4.jpg?v=latin1"}
    assert requests["/ok0.jpg"] == requests["/ok1.jpg"] == requests["/ok2.jpg"] == 1
    # retries=1: a 404 is asked for twice (img2dataset retries any failed fetch)
    assert all(requests[f"/missing{i}.jpg"] == 2 for i in range(3))


def test_rerun_skips_finished_shards(downloaded, site):
    cfg, table, first, _ = downloaded
    site[1].requests.clear()
    again = download_shards(cfg, local_only=True)
    assert sum(site[1].requests.values()) == 0
    assert again["shards_skipped"] == first["shards"] and again["shards_downloaded"] == 0
    assert again["written"] == first["written"] and again["failed_by_reason"] == first["failed_by_reason"]


def test_driver_planner_gives_the_same_parts(downloaded, tmp_path):
    cfg, _, _, _ = downloaded
    local = cfg.model_copy(update={"output": str(tmp_path / "local"), "planner": "driver"})
    a = json.loads((Path(cfg.output) / "_parts" / "_manifest.json").read_text())
    b = plan(local)
    assert [p["rows"] for p in a["parts"]] == [p["rows"] for p in b["parts"]]
    for pa_, pb in zip(a["parts"], b["parts"]):
        ta = pq.read_table(Path(cfg.output) / "_parts" / pa_["file"])
        tb = pq.read_table(tmp_path / "local" / "_parts" / pb["file"])
        assert ta.equals(tb)


def test_changed_settings_are_refused(downloaded):
    cfg, _, _, _ = downloaded
    with pytest.raises(DownloadError, match="image_size"):
        plan(cfg.model_copy(update={"image_size": 64}))


def test_missing_column_is_a_clear_error(ray_local, site, tmp_path):
    url_table(site, tmp_path / "urls.tsv")
    cfg = config(tmp_path / "urls.tsv", tmp_path / "out").model_copy(update={"caption_col": "caption"})
    with pytest.raises(DownloadError, match="caption"):
        download_shards(cfg)


def test_parquet_and_jsonl_inputs(ray_local, site, tmp_path):
    """The same rows as parquet and jsonl plan to the same parts as the TSV."""
    import pyarrow as pa

    url_table(site, tmp_path / "urls.tsv")
    lines = (tmp_path / "urls.tsv").read_bytes().splitlines()[1:]
    rows = [dict(zip(("link", "text"), (f.decode("utf-8", "replace") for f in line.split(b"\t")))) for line in lines]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "urls.parquet")
    (tmp_path / "urls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifests = [plan(config(tmp_path / f"urls.{ext}", tmp_path / ext, planner="driver"))
                 for ext in ("tsv", "parquet", "jsonl")]
    assert len({json.dumps([p["rows"] for p in m["parts"]]) for m in manifests}) == 1
    assert {m["duplicates_removed"] for m in manifests} == {3}


# ----------------------------------------------------------------------------------- kill and resume


def test_kill_and_resume(ray_local, tmp_path):
    """SIGKILL the whole `jobs.download` process group mid-way, re-run: same samples as an
    uninterrupted run, and no URL of a shard finished before the kill is fetched again. The server answers the first
    three parts' images (one part, one shard, at a time: max_parts_in_flight 1) and holds the fourth's until the kill:
    the job is killed part way whatever the machine's speed."""
    folder = tmp_path / "site"
    folder.mkdir()
    n = 48
    for i in range(n):
        (folder / f"img{i}.jpg").write_bytes(jpeg(1000 + i))
    with LoopbackServer(folder) as server:
        table = tmp_path / "urls.csv"
        table.write_text("url,caption\n" + "".join(f"{server.url(f'img{i}.jpg')},picture {i}\n" for i in range(n)))
        # a held request outlasts no timeout of img2dataset's (it would count the image failed and go on)
        common = dict(image_size=IMAGE_SIZE, rows_per_shard=4, threads_per_task=2, max_parts_in_flight=1,
                      disallowed_header_directives=[], timeout=600.0)
        reference = DownloadConfig(input=str(table), output=str(tmp_path / "reference"), **common)
        download_shards(reference, local_only=True)
        server.requests.clear()

        out = tmp_path / "out"
        cfg_file = tmp_path / "download.yaml"
        cfg_file.write_text(yaml.safe_dump({"download": {"input": str(table), "output": str(out), **common},
                                            "ray": {"num_cpus": 2}}))
        # planned here, the job reuses the plan: its parts (about 4 rows each: URLs go to buckets by hash) in the
        # order they run; the first three answered, the fourth's images held until server.open()
        manifest = plan(load_download_config(cfg_file).download)
        first = manifest["parts"][:3]
        server.serve_first = sum(part["rows"] for part in first)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.Popen([sys.executable, "-m", "jobs.download", "--config", str(cfg_file)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + scaled(240)
            while len(list(out.glob("*_stats.json"))) < 3:
                assert proc.poll() is None, "the download finished before it could be interrupted"
                assert time.monotonic() < deadline, "no shard finished in time"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the job and everything it started (its local Ray)
            proc.wait()
        time.sleep(2)
        finished = {p.name[: -len("_stats.json")] for p in out.glob("*_stats.json")}
        stamps = {name: (out / f"{name}.tar").stat().st_mtime_ns for name in finished}
        total = json.loads((out / "_parts" / "_manifest.json").read_text())["parts"]
        assert finished == {shard_name(part["shard"], manifest["shard_digits"]) for part in first}, finished
        assert len(finished) < len(total), "killed while the fourth shard's images were held"
        before = dict(server.requests)
        server.open()

        resumed = download_shards(load_download_config(cfg_file).download, local_only=True)

    assert resumed["shards_skipped"] == len(finished)
    assert resumed["shards_complete"] == resumed["shards"] and resumed["written"] == n
    assert {name: (out / f"{name}.tar").stat().st_mtime_ns for name in finished} == stamps
    done_urls = {s["url"] for key, s in read_samples(out).items() if key[:5] in finished}
    assert done_urls and all(server.requests["/" + u.rsplit("/", 1)[1]] == 1 for u in done_urls)
    # Only the unfinished shards' URLs were asked for after the kill (at most once more each).
    after = {p: server.requests[p] - before.get(p, 0) for p in server.requests}
    assert all(after.get("/" + u.rsplit("/", 1)[1], 0) == 0 for u in done_urls)
    assert sum(after.values()) == n - len(done_urls)

    got = {k: (s["url"], s["txt"], s["sha"]) for k, s in read_samples(out).items()}
    want = {k: (s["url"], s["txt"], s["sha"]) for k, s in read_samples(tmp_path / "reference").items()}
    assert got == want and len(got) == n


def test_job_cli_prints_and_logs_the_summary_to_mlflow(downloaded, mlflow_uri, tmp_path, capsys):
    from mlflow import MlflowClient

    from jobs.download import main

    cfg, table, summary, _ = downloaded
    cfg_file = tmp_path / "download.yaml"
    cfg_file.write_text(yaml.safe_dump({"run": {"name": "dl", "experiment": "downloads"},
                                        "download": cfg.model_dump(mode="json"), "tracking": {"uri": mlflow_uri}}))
    assert main(["--config", str(cfg_file)]) == 0  # a re-run: every shard already finished
    out = capsys.readouterr().out
    assert f"written {summary['written']}, failed {summary['failed']}" in out and REASON_404 in out
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("downloads").experiment_id])
    assert run.data.metrics["written"] == summary["written"]
    assert run.data.metrics["duplicates_removed"] == table["duplicates"]
    assert run.data.metrics["failed.HTTP_Error_404_File_not_found"] == 3
    assert run.data.params["download.image_size"] == str(IMAGE_SIZE)
    assert main(["--config", str(cfg_file), "--set", "download.nope=1"]) == 2


def test_hung_part_is_cancelled_counted_and_retried(ray_local, tmp_path):
    """A part that outlives part_timeout_s is killed and counted; the run goes on; a re-run completes it."""
    folder = tmp_path / "site"
    folder.mkdir()
    for i in range(4):
        (folder / f"slow{i}.jpg").write_bytes(jpeg(2000 + i))
    with LoopbackServer(folder, delay_s=4.0) as server:
        table = tmp_path / "urls.jsonl"
        table.write_text("".join(json.dumps({"url": server.url(f"slow{i}.jpg"), "caption": f"slow {i}"}) + "\n"
                                 for i in range(4)))
        cfg = DownloadConfig(input=str(table), output=str(tmp_path / "out"), image_size=IMAGE_SIZE, rows_per_shard=2,
                             threads_per_task=1, disallowed_header_directives=[], part_timeout_s=2.5)
        first = download_shards(cfg, local_only=True)
        assert first["shards_failed"] == first["shards"] and first["written"] == 0 and first["failed"] == 4
        [(reason, n)] = first["failed_by_reason"].items()
        assert reason == "part failed: timed out after 2.5s" and n == 4
        assert not list((tmp_path / "out").glob("*.tar"))  # nothing half-written is visible
        second = download_shards(cfg.model_copy(update={"part_timeout_s": 120}), local_only=True)
    assert second["written"] == 4 and second["shards_complete"] == second["shards"]
