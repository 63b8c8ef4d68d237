"""Write one benchmark's section of docs/BENCHMARKS.md, leaving the other sections as they are."""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names; ratios are measured side by side in one run.\n"


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def load() -> str:
    """The 1 / 5 / 15-minute load averages now: how much else ran beside a measurement."""
    return "load average at the end " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
