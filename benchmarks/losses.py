"""Pairwise-logit benchmarks: PPCL / PML logits and Llip contextualised cosines, side by side on CPU.

Run (one command; writes the "losses" section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.losses            # or: make bench
    .venv/bin/python -m benchmarks.losses --quick    # small sizes, prints the table, writes nothing

What is compared (all float32, same inputs, same process type, one run):
- PPCL and PML logits (models.distributions.ppcl_logits / pml_logits, one augmented matrix product)
  against (a) the broadcast (B, B, D) form of the papers' pseudo-code and (b) one plain
  (B, D) @ (D, B) matrix product, the floor for any B x B similarity.
- Llip cosines (models.llip_mixer.LlipMixer, chunked + checkpointed) against LlipMixer.naive_pair_cos,
  which materialises the (B, N, D) contextualised features at once.

How it is measured (subprocesses run with MALLOC_MMAP_THRESHOLD_=131072, so freed tensors go
back to the OS at once):
- memory: each (form, size, mode) in its own fresh subprocess. After a small warm-up and building
  the inputs it resets the kernel's peak-RSS counter (writes "5" to /proc/self/clear_refs), runs
  the operation once and reports VmHWM - VmRSS(before): the extra resident memory the call
  needed, output included.
- time: all forms of one (size, mode) in one subprocess, called round-robin after a warm-up, so
  load from other jobs on the machine hits them alike; the minimum over the repeats is reported
  (the median is printed too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# measurement inside one subprocess
# --------------------------------------------------------------------------------------------


def status_kb(field: str) -> int:
    """A /proc/self/status field in kB (VmRSS, VmHWM): this process's resident and peak resident memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pair_inputs(b: int, d: int, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mu1 = F.normalize(torch.randn(b, d, generator=g), dim=-1)
    mu2 = F.normalize(torch.randn(b, d, generator=g), dim=-1)
    lv1 = torch.randn(b, d, generator=g) - 8
    lv2 = torch.randn(b, d, generator=g) - 8
    xs = [t.requires_grad_(grad) for t in (mu1, lv1, mu2, lv2)]
    return xs, torch.randn(b, b, generator=g)


def _pair_fn(form: str, b: int, d: int, grad: bool):
    from models.distributions import pml_logits, ppcl_logits

    (mu1, lv1, mu2, lv2), upstream = _pair_inputs(b, d, grad)
    s, bias = torch.tensor(10.0), torch.tensor(-10.0)
    a, shift = torch.tensor(5.0), torch.tensor(5.0)

    def ppcl_broadcast():
        dots = (mu1[:, None, :] * mu2[None, :, :]).sum(-1)
        var = (lv1.exp()[:, None, :] + lv2.exp()[None, :, :]).sum(-1)
        return s * (dots - 0.5 * var) + bias

    def pml_broadcast():
        mu_d = (mu1[:, None, :] - mu2[None, :, :]).pow(2).sum(-1)
        var = (lv1.exp()[:, None, :] + lv2.exp()[None, :, :]).sum(-1)
        return -a * (mu_d + var) + shift

    forms = {
        "ppcl": lambda: ppcl_logits(mu1, lv1, mu2, lv2, s, bias),
        "pml": lambda: pml_logits(mu1, lv1, mu2, lv2, a, shift),
        "matmul": lambda: mu1 @ mu2.T,
        "ppcl_broadcast": ppcl_broadcast,
        "pml_broadcast": pml_broadcast,
    }
    fn = forms[form]
    if not grad:
        return fn

    def fwd_bwd():
        out = fn()
        out.backward(upstream)
        for t in (mu1, lv1, mu2, lv2):
            t.grad = None
        return out

    return fwd_bwd


def _llip_fn(form: str, b: int, d: int, grad: bool, k: int = 64, heads: int = 8):
    from models.llip_mixer import LlipMixer

    torch.manual_seed(0)
    mixer = LlipMixer(d, heads=heads, tau=5.0)
    for p in mixer.parameters():
        p.requires_grad_(grad)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(b, k, d, generator=g).requires_grad_(grad)
    query = torch.randn(b, d, generator=g).requires_grad_(grad)
    text = torch.randn(b, d, generator=g).requires_grad_(grad)
    upstream = torch.randn(b, b, generator=g)
    fn = {"llip_chunked": mixer.forward, "llip_naive": mixer.naive_pair_cos}[form]
    if not grad:
        return lambda: fn(tokens, query, text)

    def fwd_bwd():
        out = fn(tokens, query, text)
        out.backward(upstream)
        for t in (tokens, query, text, *mixer.parameters()):
            t.grad = None
        return out

    return fwd_bwd


def _make(form: str, b: int, d: int, grad: bool):
    return (_llip_fn if form.startswith("llip") else _pair_fn)(form, b, d, grad)


def measure_memory(form: str, b: int, d: int, mode: str) -> dict:
    """Runs in a fresh process: extra peak RSS (MB) of one call, after a small warm-up."""
    grad = mode == "fwd+bwd"
    with torch.enable_grad() if grad else torch.no_grad():
        _make(form, 32, d, grad)()  # warm-up: kernels, thread pool, allocator
        fn = _make(form, b, d, grad)
        before = status_kb("VmRSS")
        if not _reset_peak():
            raise RuntimeError("cannot reset the peak-RSS counter (/proc/self/clear_refs)")
        out = fn()
        peak_kb = status_kb("VmHWM") - before
        del out
    return {"form": form, "b": b, "d": d, "mode": mode, "peak_mb": peak_kb / 1024}


def measure_time(forms: list[str], b: int, d: int, mode: str, repeats: int) -> dict:
    """Runs in one process: the forms are called round-robin (so machine load hits all alike);
    returns the minimum and median wall time and the minimum process CPU time of each."""
    grad = mode == "fwd+bwd"
    wall: dict[str, list[float]] = {f: [] for f in forms}
    cpu: dict[str, list[float]] = {f: [] for f in forms}
    with torch.enable_grad() if grad else torch.no_grad():
        for f in forms:
            _make(f, 32, d, grad)()  # warm-up: kernels, thread pool
        fns = {f: _make(f, b, d, grad) for f in forms}
        for _ in range(repeats):
            for f in forms:
                t0, c0 = time.perf_counter(), time.process_time()
                out = fns[f]()
                wall[f].append(time.perf_counter() - t0)
                cpu[f].append(time.process_time() - c0)
                del out
    return {f: {"min": min(wall[f]), "median": statistics.median(wall[f]), "cpu": min(cpu[f])} for f in forms}


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _sub(args: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    cmd = [sys.executable, "-m", "benchmarks.losses", *args]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_group(forms: list[str], b: int, d: int, mode: str, repeats: int) -> dict[str, dict]:
    """Time all forms side by side in one subprocess, then each form's memory in its own."""
    t = _sub(["--time", ",".join(forms), "--b", str(b), "--d", str(d), "--mode", mode, "--repeats", str(repeats)])
    result = {}
    for f in forms:
        m = _sub(["--memory", f, "--b", str(b), "--d", str(d), "--mode", mode])
        result[f] = {"seconds": t[f]["min"], "median": t[f]["median"], "cpu": t[f]["cpu"], "peak_mb": m["peak_mb"]}
        print(
            f"  {f:15s} B={b:5d} D={d:4d} {mode:8s} wall min {t[f]['min'] * 1e3:10.1f} ms "
            f"(median {t[f]['median'] * 1e3:10.1f}) cpu {t[f]['cpu'] * 1e3:10.1f} ms  peak {m['peak_mb']:10.1f} MB",
            flush=True,
        )
    return result


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _fmt_mb(mb: float) -> str:
    return f"{mb:,.1f}"


def _t(r: dict) -> str:
    """wall-min ms / cpu ms."""
    return f"{_fmt_ms(r['seconds'])} / {_fmt_ms(r['cpu'])}"


def pair_section(sizes: dict) -> tuple[str, list[str]]:
    big, small, d, rep = sizes["pair_big"], sizes["pair_small"], sizes["pair_d"], sizes["repeats"]
    rows, verdicts = [], []
    for kind in ("ppcl", "pml"):
        bc_name = f"{kind}_broadcast"
        g_small = run_group([kind, "matmul", bc_name], small, d, "fwd", max(3, rep // 2))
        g_big = run_group([kind, "matmul"], big, d, "fwd", rep)
        g_bwd = run_group([kind, "matmul"], big, d, "fwd+bwd", rep)
        scale = (big / small) ** 2  # the broadcast form is O(B^2 D) in time and memory
        bc = g_small[bc_name]
        bc_big = {"seconds": bc["seconds"] * scale, "cpu": bc["cpu"] * scale, "peak_mb": bc["peak_mb"] * scale}
        for b, g, bcx, note in ((small, g_small, bc, "measured"), (big, g_big, bc_big, f"extrapolated x{scale:.0f} from B={small}")):
            ours, mm = g[kind], g["matmul"]
            rows.append(
                f"| {kind.upper()} | {b} | {d} | fwd | {_t(ours)} | {_fmt_mb(ours['peak_mb'])} | {_t(mm)} | {_fmt_mb(mm['peak_mb'])} "
                f"| {_t(bcx)} | {_fmt_mb(bcx['peak_mb'])} ({note}) | {ours['seconds'] / mm['seconds']:.2f}x / {ours['cpu'] / mm['cpu']:.2f}x "
                f"| {bcx['peak_mb'] / ours['peak_mb']:,.0f}x |"
            )
        ours, mm = g_bwd[kind], g_bwd["matmul"]
        rows.append(
            f"| {kind.upper()} | {big} | {d} | fwd+bwd | {_t(ours)} | {_fmt_mb(ours['peak_mb'])} | {_t(mm)} | {_fmt_mb(mm['peak_mb'])} "
            f"| not run | - | {ours['seconds'] / mm['seconds']:.2f}x / {ours['cpu'] / mm['cpu']:.2f}x | - |"
        )
        ours, mm = g_big[kind], g_big["matmul"]
        t_wall, t_cpu = ours["seconds"] / mm["seconds"], ours["cpu"] / mm["cpu"]
        m_ratio = bc_big["peak_mb"] / ours["peak_mb"]
        m_small = bc["peak_mb"] / g_small[kind]["peak_mb"]
        ok_t = "met" if t_wall <= 1.3 else "MISSED"
        ok_m = "met" if m_ratio >= 50 else "MISSED"
        verdicts.append(
            f"- {kind.upper()} logits at B={big}, D={d}: {t_wall:.2f}x the plain matmul's wall time ({t_cpu:.2f}x its CPU time); "
            f"target <= 1.3x: **{ok_t}**. Peak memory {m_ratio:,.0f}x below the broadcast form; target >= 50x: **{ok_m}** "
            f"(broadcast extrapolated from B={small}; measured side by side at B={small} the ratio is {m_small:,.0f}x)."
        )
    header = (
        "| logits | B | D | mode | ours ms (wall / cpu) | ours peak MB | matmul ms (wall / cpu) | matmul peak MB "
        "| broadcast ms (wall / cpu) | broadcast peak MB | ours / matmul time (wall / cpu) | broadcast / ours memory |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows), verdicts


def llip_section(sizes: dict) -> tuple[str, list[str]]:
    b, d, rep = sizes["llip_b"], sizes["llip_d"], sizes["llip_repeats"]
    rows, verdicts = [], []
    bnd_mb = b * b * d * 4 / 2**20
    for mode in ("fwd", "fwd+bwd"):
        g = run_group(["llip_chunked", "llip_naive"], b, d, mode, rep)
        c, n = g["llip_chunked"], g["llip_naive"]
        rows.append(
            f"| {b} x {b} | {mode} | {_t(c)} | {_fmt_mb(c['peak_mb'])} | {_t(n)} | {_fmt_mb(n['peak_mb'])} "
            f"| {c['seconds'] / n['seconds']:.2f}x / {c['cpu'] / n['cpu']:.2f}x | {n['peak_mb'] / c['peak_mb']:,.0f}x |"
        )
        ok = "met" if c["seconds"] <= n["seconds"] else "MISSED"
        resident = "met" if c["peak_mb"] < bnd_mb else "MISSED"
        verdicts.append(
            f"- Llip {mode} at B = N = {b}: chunked {c['seconds'] / n['seconds']:.2f}x the naive wall time "
            f"({c['cpu'] / n['cpu']:.2f}x its CPU time); target no slower: **{ok}**. Peak {_fmt_mb(c['peak_mb'])} MB "
            f"vs {_fmt_mb(n['peak_mb'])} MB; one B x N x D float32 tensor is {_fmt_mb(bnd_mb)} MB, so none is "
            f"resident: **{resident}**."
        )
    header = (
        "| B x N | mode | chunked ms (wall / cpu) | chunked peak MB | naive ms (wall / cpu) | naive peak MB "
        "| chunked / naive time (wall / cpu) | naive / chunked memory |\n|---|---|---|---|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows), verdicts


FULL = dict(pair_big=4096, pair_small=1024, pair_d=768, repeats=6, llip_b=1024, llip_d=512, llip_repeats=3)
QUICK = dict(pair_big=512, pair_small=128, pair_d=64, repeats=3, llip_b=64, llip_d=64, llip_repeats=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes; print only, do not write docs/BENCHMARKS.md")
    ap.add_argument("--time", help=argparse.SUPPRESS)
    ap.add_argument("--memory", help=argparse.SUPPRESS)
    ap.add_argument("--b", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--d", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["pairs", "llip"], help="run one of the two sections")
    args = ap.parse_args(argv)
    if args.time:
        print(json.dumps(measure_time(args.time.split(","), args.b, args.d, args.mode, args.repeats)))
        return
    if args.memory:
        print(json.dumps(measure_memory(args.memory, args.b, args.d, args.mode)))
        return

    sizes = QUICK if args.quick else FULL
    if args.only != "llip":
        print("PPCL / PML logits", flush=True)
        table, verdicts = pair_section(sizes)
        publish("losses", pair_markdown(sizes, table, verdicts), args.quick)
    if args.only != "pairs":
        print("Llip cosines", flush=True)
        table, verdicts = llip_section(sizes)
        publish("llip", llip_markdown(sizes, table, verdicts), args.quick)


def publish(section: str, md: str, quick: bool) -> None:
    from benchmarks.report import write_section

    print(md)
    if not quick:
        write_section(section, md)
        print(f"wrote the {section!r} section of docs/BENCHMARKS.md")


def pair_markdown(sizes: dict, table: str, verdicts: list[str]) -> str:
    from benchmarks.report import machine

    return f"""## Losses: pairwise logits (`python -m benchmarks.losses --only pairs`)

Machine: {machine()}; CPU, float32, measured side by side in one run ({time.strftime('%Y-%m-%d')}).
{MEASURED}

### PPCL / PML logits (`models.distributions.ppcl_logits`, `pml_logits`)

Ours: one matrix product of (B, D + 2) augmented operands (the squared norms and variance traces
ride along as extra columns), no (B, B, D) intermediate. Plain matmul: `mu1 @ mu2.T`, the floor
for any B x B similarity. Broadcast: the papers' pseudo-code form with (B, B, D) intermediates.
At B = {sizes['pair_big']}, D = {sizes['pair_d']} one (B, B, D) float32 tensor is
{sizes['pair_big'] ** 2 * sizes['pair_d'] * 4 / 1e9:.0f} GB, more than this machine has, so the broadcast form is measured at
B = {sizes['pair_small']} and extrapolated by (B / {sizes['pair_small']})^2 (it is exactly quadratic in B).

{table}

{chr(10).join(verdicts)}
"""


def llip_markdown(sizes: dict, table: str, verdicts: list[str]) -> str:
    from benchmarks.report import machine

    return f"""## Llip contextualised cosines (`python -m benchmarks.losses --only llip`)

`models.llip_mixer.LlipMixer`, K = 64 mixture tokens, 8 heads, D = {sizes['llip_d']}. Machine: {machine()};
CPU, float32, measured side by side in one run ({time.strftime('%Y-%m-%d')}).
{MEASURED}

Chunked (ours): image rows in chunks (~64 MiB per intermediate) inside a custom autograd
function; the forward forms z one chunk at a time and keeps only the (B, N) cosines and norms;
the backward recomputes each chunk's attention and mixture c and uses z.t = c.(T W_o) and
||z||^2 = c (W_o^T W_o) c^T, so it needs no z either. Naive: `LlipMixer.naive_pair_cos`, the same
formulas with the (B, N, D) features and (heads, B, N, K) attention weights materialised (what
autograd stores). Both are measured at the same B = N, forward and forward+backward.

{table}

{chr(10).join(verdicts)}
"""


MEASURED = """**Peak MB** is the extra resident memory one call needed, output included, measured in a fresh
subprocess per cell: the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` = 5) just
before the call and read back after it (VmHWM - VmRSS), with `MALLOC_MMAP_THRESHOLD_=131072` so
freed tensors leave the process at once. **ms** is the minimum wall time over repeated calls, the
forms of one row group timed round-robin in one subprocess. Ratios are what to compare: absolute
times move with other load on the machine."""


if __name__ == "__main__":
    main()
