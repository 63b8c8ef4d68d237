"""The download stage's configuration: its download section (`DownloadConfig`) and what `jobs.download` reads of a
config file (`DownloadDocument`, `load_download_config`). Imports pydantic and `pipelines.config` alone: the digits
(a stage above) build their download from it, and a download's start-up loads neither torch nor the model registry.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipelines.config import (ConfigError, Document, RayConfig, RunConfig, Section, TrackingConfig, read_config_file,
                              stage_document)


class DownloadConfig(Section):
    """`jobs.download`: URL table -> de-duplicated parts -> img2dataset on Ray tasks -> webdataset shards."""

    # URL table: a file, a folder of files, or a glob; local path or fsspec URI (s3://, gs://, ...).
    input: str
    # auto: from the file extension (.parquet, .csv, .tsv, .jsonl / .json).
    input_format: Literal["auto", "parquet", "csv", "tsv", "jsonl"] = "auto"
    url_col: str = "url"
    # None: no captions.
    caption_col: str | None = "caption"
    # Extra table columns copied into each sample's json (img2dataset save_additional_columns).
    additional_columns: list[str] = Field(default_factory=list)
    # Folder (or fsspec URI) for NNNNN.tar + NNNNN.parquet + NNNNN_stats.json and the run summary.
    output: str
    image_size: int = Field(256, ge=8, le=8192)
    resize_mode: Literal["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"] = "border"
    encode_format: Literal["jpg", "png", "webp"] = "jpg"
    # None: 95 for jpg/webp, compression 9 for png (png takes 0-9).
    encode_quality: int | None = Field(None, ge=0, le=100)
    # Extra attempts per URL after a failed fetch, and the per-request timeout in seconds.
    retries: int = Field(0, ge=0, le=20)
    timeout: float = Field(10.0, gt=0)
    min_image_size: int = Field(0, ge=0)
    # Larger source images are counted as failed ("image area too large"); None: no limit.
    max_image_area: float | None = Field(None, gt=0)
    # De-duplicate and split the table with Ray Data (ray_data) or in the driver (driver, same result);
    # auto: the driver for tables up to plan_local_max_mb of files.
    planner: Literal["auto", "ray_data", "driver"] = "auto"
    plan_local_max_mb: float = Field(256.0, ge=0)
    # About this many URLs per part; one part = one Ray task = one output shard.
    rows_per_shard: int = Field(10000, ge=1)
    # Download threads inside each task, CPUs Ray reserves per task (one process each),
    # and at most this many parts running at once (None: as many as the cluster's CPUs allow).
    threads_per_task: int = Field(64, ge=1, le=1024)
    cpus_per_task: float = Field(1.0, gt=0)
    max_parts_in_flight: int | None = Field(None, ge=1)
    # A part still running after this many seconds is cancelled and counted as failed (re-run retries it).
    part_timeout_s: float = Field(3600.0, gt=0)
    # X-Robots-Tag directives that opt an image out (img2dataset's default list); [] disables the check.
    disallowed_header_directives: list[str] = Field(
        default_factory=lambda: ["noai", "noimageai", "noindex", "noimageindex"])
    user_agent_token: str | None = None
    compute_hash: Literal["md5", "sha256", "sha512"] | None = "sha256"
    extract_exif: bool = False

    @field_validator("additional_columns")
    @classmethod
    def _columns(cls, value: list[str]) -> list[str]:
        reserved = {"key", "caption", "url", "width", "height", "original_width", "original_height", "status",
                    "error_message", "exif", "md5", "sha256", "sha512"}
        clash = sorted(reserved & set(value))
        if clash:
            raise ValueError(f"{', '.join(clash)} reserved by img2dataset")
        return value

    @model_validator(mode="after")
    def _png_quality(self) -> "DownloadConfig":
        if self.encode_format == "png" and self.encode_quality is not None and self.encode_quality > 9:
            raise ValueError("encode_quality: png takes a compression level 0-9")
        return self


class DownloadDocument(Document):
    """What `jobs.download` reads of a config file: its download, run, tracking and ray sections. An experiment file's
    other sections may stand beside them (`pipelines.config.stage_document`; unchecked here: the model registry, and
    with it torch, is not imported for a download)."""

    run: RunConfig = Field(default_factory=RunConfig)
    download: DownloadConfig
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)


def load_download_config(path: str | Path, overrides: list[str] | None = None) -> DownloadDocument:
    data = read_config_file(path, overrides)
    if data.get("download") is None:
        raise ConfigError(f"{path}: no `download:` section")
    return stage_document(DownloadDocument, data)
