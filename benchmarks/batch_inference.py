"""Batch inference: images/s of `jobs.evaluate` / `jobs.embed`'s Ray Data actor pool against a plain
single-process torch loop over the same tar files and the same saved model; writes the
"batch_inference" section of docs/BENCHMARKS.md.

    .venv/bin/python -m benchmarks.batch_inference            # writes the section
    .venv/bin/python -m benchmarks.batch_inference --quick    # small sizes, prints only

Both sides decode the same webdataset shards (pipelines.data.eval_reader), run `encode_image` of the same
model file and write the embeddings as parquet. The plain loop uses every core for torch (one
process, `torch.set_num_threads(cores)`); the pool is timed with 1 actor x `cores` threads and with
`cores` actors x 1 thread. The local Ray is started before timing (a cluster is up when a job runs);
actor start-up and model loading are inside the timing. Rounds alternate the variants; the median
per-round ratio is reported.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL = dict(img_size=96, patch_size=16, vision_width=384, vision_depth=6, vision_heads=6, vision_pre_norm=False,
             context_length=32, text_width=256, text_depth=4, text_heads=4, embed_dim=256)


def write_shards(folder: Path, n: int, size: int, per_shard: int = 500) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, n, per_shard):
        path = folder / f"{start // per_shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(start, min(n, start + per_shard)):
                buf = io.BytesIO()
                Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG")
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"caption {i}".encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def plain_loop(model_file: str, paths: list[str], size: int, out: Path, threads: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from models.model_file import load_model
    from pipelines.evaluate.inference import fixed_lists
    from pipelines.data.eval_reader import iter_local_batches

    torch.set_num_threads(threads)
    model = load_model(model_file)
    n = 0
    with torch.no_grad():
        for i, batch in enumerate(iter_local_batches(paths, size, batch_size=256)):
            out_ = model.encode_image(torch.as_tensor(batch["image"]))
            pq.write_table(pa.table({"key": list(batch["key"]), **fixed_lists(out_)}), out / f"{i}.parquet")
            n += len(batch["key"])
    return n


def ray_pool(model_file: str, paths: list[str], size: int, out: Path, actors: int, threads: int) -> int:
    import pyarrow.parquet as pq

    from pipelines.evaluate.inference import InferenceOptions, write_image_embeddings

    folder = write_image_embeddings(model_file, paths, size, out, InferenceOptions(concurrency=actors, threads=threads))
    return pq.read_table(folder).num_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=8000)
    args = parser.parse_args()
    n = 500 if args.quick else args.images
    cores = os.cpu_count() or 1

    import torch

    from models import create_model
    from models.model_file import save_model
    from pipelines.cluster.runtime import init_ray

    # the decode tasks need a CPU beside actors that hold every core's worth of threads
    init_ray(num_cpus=cores + 2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        model_file = str(tmp / "model.safetensors")
        save_model(create_model("clip_tiny", **SMALL).state_dict(), model_file, "clip_tiny", SMALL)
        paths = write_shards(tmp / "shards", n, SMALL["img_size"])
        variants = {
            f"plain torch loop, 1 process x {cores} threads": lambda o: plain_loop(model_file, paths, 96, o, cores),
            f"Ray Data actor pool, 1 actor x {cores} threads": lambda o: ray_pool(model_file, paths, 96, o, 1, cores),
            f"Ray Data actor pool, {cores} actors x 1 thread": lambda o: ray_pool(model_file, paths, 96, o, cores, 1),
        }
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, run in variants.items():
                out = tmp / f"out_{r}_{len(rates[name])}_{abs(hash(name))}"
                out.mkdir()
                t0 = time.perf_counter()
                done = run(out)
                rate = done / (time.perf_counter() - t0)
                assert done == n, (name, done)
                rates[name].append(rate)
                print(f"round {r}: {name}: {rate:.0f} images/s", flush=True)
    base = next(iter(rates))
    rows = ["| variant | images/s (median) | ratio vs plain loop (median per round) |", "| --- | ---: | ---: |"]
    for name, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, rates[base]))
        rows.append(f"| {name} | {statistics.median(values):.0f} | {ratio:.2f}x |")
    from benchmarks.report import machine, write_section

    table = "\n".join(rows)
    print(table)
    if args.quick:
        return
    write_section("batch_inference", f"""## Batch inference: Ray Data actor pool vs a plain torch loop (`benchmarks/batch_inference.py`)

`python -m benchmarks.batch_inference --images {n} --rounds {args.rounds}` on {machine()}, {cores} cores: {n} JPEGs of 96x96 in {len(paths)} shards,
`clip_tiny` at the train-step benchmark's `small` size (ViT 6x384, patch 16, 256-d embeddings), batches of 256,
embeddings written as parquet by both sides; {args.rounds} alternating rounds.

{table}

Ray's own processes (raylet, GCS, the dashboard, the data executor) share the {cores} cores with the
actors here, and each run pays actor start-up and model loading (a few seconds: a fixed cost, so the ratio
falls on small sets; run with `--images 2000` to see it). The reader streams (no caching pass) and moves
images between processes as uint8, scaled to the model's range inside the actor. The pool starts with one actor and adds
actors up to `--actors` while batches queue: on a cluster, one actor per GPU (`--gpus-per-actor 1`) or per few CPU cores
on every node, each reading its own blocks; the plain loop is bound to one process on one machine.
""")


if __name__ == "__main__":
    main()
