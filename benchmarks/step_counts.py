"""What a training step costs beyond its arithmetic, counted on the CPU: aten ops, host syncs, memory-bound bytes.

Run:

    .venv/bin/python -m benchmarks.step_counts                 # b16, batch 256: writes the section "step_counts"
    .venv/bin/python -m benchmarks.step_counts --label before  # the same, filed as the "before" table
    .venv/bin/python -m benchmarks.step_counts --size tiny --batch 8 --quick   # prints only

On a GPU a step's time beyond its FLOPs goes to three things, and all three can be counted without one: kernel
launches (one per aten op that is not a view), host syncs (the host waits for the device to drain: ``.item()``,
``nonzero``, boolean-mask indexing, a device-to-host copy, a Python branch on a tensor), and memory-bound passes
(elementwise ops and reductions read and write whole tensors at memory bandwidth). One full training step as
``benchmarks.train_step`` times it (forward with the method's masked copies or MSDA, backward, AdamW) is run
under a ``TorchDispatchMode`` that sees every aten op:

- **ops**: every aten op dispatched on the device; **kernels**: those that are not views or allocations (a
  proxy for GPU kernel launches). The AdamW step is the trainer's fused kernel, counted as one op.
- **syncs**: data-dependent ops (``_local_scalar_dense``, ``nonzero``, ``masked_select``, indexing with a boolean
  mask, any op torch tags ``data_dependent_output`` / ``dynamic_output_shape``) on a device tensor, and copies from
  the device to the host, each named by the project file:line the Python stack shows at the op.
- **bytes**: input + output nbytes of each op: pointwise and reduction ops (torch's own tags), other memory-bound
  ops (copies, concatenation, indexing, sort, norms, softmax), and matmul / convolution / attention separately.

How, at the paper's size on a 2-core CPU: the counted step runs on the ``meta`` device (shapes only, no
arithmetic), with ``F.scaled_dot_product_attention`` routed to the fused attention op a real CPU or GPU step uses
(meta would otherwise take the unfused math path). Meta has no values, so the data-dependent results (the text
trim's caption length, the masked rows, MSDA's Mixup / CutMix branch) come from a real CPU step of the same batch,
image size, patches and context with narrow towers (width 32, 2 blocks: no random draw depends on width), seeded
alike and recorded in order; the meta step replays them. On meta every model tensor is a "device" tensor and
host-side tensors (AdamW's step counters, GPO's lengths) stay on the CPU, so a sync on meta is one a GPU step would
take. The step runs in float32: bf16 autocast would halve the towers' bytes but not the float32 heads' and losses'.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.train_step import LABEL, MIXTURE_MODELS, PAIRS, SIZES, build, captions
from models.tokenizer import tokenize
from models.towers import TowerConfig

ROOT = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())
aten = torch.ops.aten
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "convolution_backward", "_fused_adamw_"}
NO_KERNEL = {"detach", "alias", "empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "_local_scalar_dense", "set_", "resize_", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
             "is_same_size"}
COPIES = {"_to_copy", "copy_"}


def op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def tensors(tree) -> list[torch.Tensor]:
    out = []
    for x in tree if isinstance(tree, (list, tuple)) else [tree]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(tensors(x))
    return out


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def data_dependent(func, args) -> bool:
    """An op whose result (a value or a shape) the host must read from the device."""
    name = op_name(func)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else []
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
    if name in COPIES:
        return False
    return torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags


def where() -> str:
    """The innermost project frame (file:line) of the Python stack at an op, else the innermost torch one; in the
    backward, the autograd node that runs it (backward:NodeName)."""
    node = torch._C._current_autograd_node()
    if node is not None:  # the backward: its Python stack is only the caller of .backward()
        return f"backward:{node.name()}"
    frames = traceback.extract_stack()[:-3]
    fallback = None
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if path == THIS or "/torch/utils/_python_dispatch" in path or "/torch/overrides" in path:
            continue
        if path.startswith(str(ROOT)) and "/.venv/" not in path:
            return f"{os.path.relpath(path, ROOT)}:{f.lineno}"
        if fallback is None and "site-packages" in path:
            fallback = f"{path.split('site-packages/')[-1]}:{f.lineno}"
    return fallback or "?"


class _Flash(torch.autograd.Function):
    """F.scaled_dot_product_attention as the one fused forward and backward op a CPU or GPU step runs."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale)
        return dq, dk, dv, None, None, None


class FusedAttention(TorchFunctionMode):
    """On meta: scaled_dot_product_attention by the fused op (a boolean mask made additive, as the CPU path does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is not None and mask.dtype == torch.bool:
                mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
            return _Flash.apply(q, k, v, mask, bool(kwargs.get("is_causal", False)), kwargs.get("scale"))
        return func(*args, **kwargs)


class StepCounter(TorchDispatchMode):
    """Counts what each aten op of a step costs. ``device``: the device type whose tensors stand for the GPU's.
    ``replay``: data-dependent results recorded by a real run (``record=True``), returned in order on meta."""

    def __init__(self, device: str = "meta", record: bool = False, replay: list | None = None):
        super().__init__()
        self.device, self.record, self.replay = device, record, replay
        self.cursor = 0
        self.recorded: list = []
        self.ops = 0
        self.kernels = 0
        self.host_ops = 0
        self.by_op: collections.Counter = collections.Counter()
        self.bytes = {"pointwise": 0, "reduction": 0, "other": 0, "matmul": 0}
        self.syncs: collections.Counter = collections.Counter()  # (op, file:line)
        self.by_kernel: collections.Counter = collections.Counter()
        self.active = True

    def copies_to_host(self, name, args, kwargs) -> bool:
        if name == "_to_copy":
            device = kwargs.get("device")
            return device is not None and torch.device(device).type == "cpu"
        return args[0].device.type == "cpu"

    def copies_from_host(self, name, args, kwargs, ins, outs) -> bool:
        src = ins[1] if name == "copy_" else ins[0]
        blocking = not (kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))
        return blocking and src.device.type == "cpu" and any(t.device.type == self.device for t in outs)

    def on_device(self, ts: list[torch.Tensor]) -> bool:
        return any(t.device.type == self.device for t in ts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten" or not self.active:
            return func(*args, **kwargs)
        name = op_name(func)
        ins = tensors(list(args) + list(kwargs.values()))
        dependent = data_dependent(func, args)
        to_host = name in COPIES and self.on_device(ins[:1]) and self.copies_to_host(name, args, kwargs)
        if dependent and (self.record or self.replay is not None):
            out = self.recorded_result(func, args, kwargs, ins)
        elif to_host and self.device == "meta":
            # no value to copy: zeros of the shape (every such copy is reported as a sync, and removed)
            out = torch.zeros(ins[0].shape, dtype=kwargs.get("dtype") or ins[0].dtype) if name == "_to_copy" else args[0]
        else:
            out = func(*args, **kwargs)
        outs = tensors(out)
        device_op = self.on_device(ins + outs)
        if not device_op:
            self.host_ops += 1
            return out
        self.ops += 1
        self.by_op[name] += 1
        if dependent:
            self.syncs[name, where()] += 1
        if to_host:
            self.syncs["copy to host", where()] += 1
        if name in COPIES and self.copies_from_host(name, args, kwargs, ins, outs):
            # torch's copy from pageable host memory without non_blocking ends in cudaStreamSynchronize
            self.syncs["blocking copy from host", where()] += 1
        if func.is_view or name in NO_KERNEL:
            return out
        self.kernels += 1
        self.by_kernel[name] += 1
        moved = nbytes(ins) + nbytes(outs)
        if name in MATMUL or "scaled_dot_product" in name:
            self.bytes["matmul"] += moved
        elif torch.Tag.pointwise in func.tags:
            self.bytes["pointwise"] += moved
        elif torch.Tag.reduction in func.tags:
            self.bytes["reduction"] += moved
        else:
            self.bytes["other"] += moved
        return out

    def recorded_result(self, func, args, kwargs, ins):
        name = op_name(func)
        if self.record:
            out = func(*args, **kwargs)
            self.recorded.append((name, out if not isinstance(out, torch.Tensor) else (out.shape, out.dtype)))
            return out
        if self.cursor >= len(self.replay):
            raise RuntimeError(f"meta step: data-dependent {name} at {where()} beyond the {len(self.replay)} recorded")
        rec_name, value = self.replay[self.cursor]
        self.cursor += 1
        if rec_name != name:
            raise RuntimeError(f"meta step: {name} at {where()} where the recorded step had {rec_name}")
        if not self.on_device(ins):
            return func(*args, **kwargs)  # a host tensor: the real op
        if name in ("index_put", "index_put_", "_index_put_impl_"):
            return args[0] if name.endswith("_") else args[0].clone()
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.Size):
            return torch.empty(value[0], dtype=value[1], device=ins[0].device)
        return value


def fused_adamw(opt: torch.optim.Optimizer, counter: StepCounter) -> None:
    """The trainer's fused AdamW step counted as its one kernel: each parameter, its gradient and both moments
    read, the parameter and both moments written (meta has no fused AdamW kernel to run)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    counter.ops += 1
    counter.kernels += 1
    counter.by_op["_fused_adamw_"] += 1
    counter.by_kernel["_fused_adamw_"] += 1
    counter.optimizer_bytes = 7 * nbytes(params)
    for p in params:
        p.grad = None


def narrow(size: TowerConfig) -> TowerConfig:
    """The same batch shapes with 32-wide, 2-block towers: a cheap real step for the data-dependent values."""
    return dataclasses.replace(size, vision_width=32, vision_depth=2, vision_heads=2, text_width=32, text_depth=2,
                               text_heads=2, embed_dim=32)


def inputs(size: TowerConfig, batch: int, device: str, kind: str):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size.img_size, size.img_size, generator=g).to(device)
    return images, tokenize(captions(kind, batch), size.context_length).to(device)


def run_step(objective, images, tokens, counter: StepCounter | None, opt=None) -> None:
    torch.manual_seed(1)  # the same random draws (masked rows, MSDA) in the recording and the counted step
    out = objective(images, tokens)
    out["loss"].backward()
    if counter is not None and images.device.type == "meta":
        fused_adamw(opt, counter)
    elif opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def count_step(name: str, size: TowerConfig, batch: int, kind: str = "full", mixture_tokens: int = 16) -> StepCounter:
    """One training step of `name` at `size` and `batch`, counted on meta with values from a narrow real step."""
    real, real_opt = build(name, narrow(size), mixture_tokens, "cpu")
    recorder = StepCounter(device="cpu", record=True)
    images, tokens = inputs(size, batch, "cpu", kind)
    with recorder:
        run_step(real, images, tokens, None, real_opt)
    del real, real_opt
    objective, opt = build(name, size, mixture_tokens, "meta")
    counter = StepCounter(device="meta", replay=recorder.recorded)
    images, tokens = inputs(size, batch, "meta", kind)
    with FusedAttention(), counter:
        run_step(objective, images, tokens, counter, opt)
    if counter.cursor != len(recorder.recorded):
        raise RuntimeError(f"{name}: the meta step replayed {counter.cursor} of {len(recorder.recorded)} recorded values")
    return counter


def memory_bytes(c: StepCounter) -> int:
    return c.bytes["pointwise"] + c.bytes["reduction"] + c.bytes["other"]


def table(counts: dict) -> str:
    lines = ["| method | baseline | ops | kernels (non-view ops) | vs baseline | host syncs | pointwise + reduction MB "
             "| other memory-bound MB | memory-bound MB vs baseline | matmul / conv / attention MB | AdamW MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in dict.fromkeys(x for pair in PAIRS for x in reversed(pair)):
        if n not in counts:
            continue
        c = counts[n]
        base = next((b for m, b in PAIRS if m == n), None)
        kr = f"{c.kernels / counts[base].kernels:.2f}x" if base in counts else "-"
        mr = f"{memory_bytes(c) / memory_bytes(counts[base]):.2f}x" if base in counts else "-"
        lines.append(f"| {LABEL[n]} | {LABEL[base] if base else '-'} | {c.ops} | {c.kernels} | {kr} "
                     f"| {sum(c.syncs.values())} "
                     f"| {(c.bytes['pointwise'] + c.bytes['reduction']) / 1e6:.0f} | {c.bytes['other'] / 1e6:.0f} "
                     f"| {mr} "
                     f"| {c.bytes['matmul'] / 1e6:.0f} | {getattr(c, 'optimizer_bytes', 0) / 1e6:.0f} |")
    return "\n".join(lines)


def sync_lines(counts: dict) -> str:
    out = []
    for n, c in counts.items():
        if c.syncs:
            where_ = ", ".join(f"`{op}` at {loc}" + (f" (x{k})" if k > 1 else "") for (op, loc), k in c.syncs.items())
            out.append(f"- {LABEL[n]}: {where_}")
        else:
            out.append(f"- {LABEL[n]}: none")
    return "\n".join(out)


def top_ops(counts: dict, k: int = 8) -> str:
    out = []
    for n, c in counts.items():
        base = next((b for m, b in PAIRS if m == n), None)
        if base not in counts:
            continue
        extra = c.by_kernel - counts[base].by_kernel
        out.append(f"- {LABEL[n]} - {LABEL[base]}: " + ", ".join(f"{op} +{v}" for op, v in extra.most_common(k)))
    return "\n".join(out)


def graph_breaks(name: str) -> tuple[int, list[str]]:
    """torch._dynamo.explain of the model's training forward + loss at the tiny size: (graph breaks, reasons)."""
    from models.registry import TINY

    torch.manual_seed(0)
    objective, _ = build(name, TINY, 8, "cpu")
    images = torch.randn(8, 3, TINY.img_size, TINY.img_size)
    tokens = tokenize(captions("short", 8), TINY.context_length)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(lambda i, t: objective(i, t)["loss"])(images, tokens)
    finally:
        torch._dynamo.reset()
    reasons = sorted({f"{b.reason.splitlines()[0][:80]} ({os.path.relpath(b.user_stack[-1].filename, ROOT)}:"
                      f"{b.user_stack[-1].lineno})" for b in explained.break_reasons if b.user_stack})
    return explained.graph_break_count, reasons


def graph_break_table(names: list[str]) -> str:
    lines = ["`train.compile` of the whole training forward + loss (`torch._dynamo.explain`, tiny size, batch 8, CPU):",
             "", "| method | graph breaks | reasons |", "| --- | --- | --- |"]
    for n in names:
        count, reasons = graph_breaks(n)
        lines.append(f"| {LABEL[n]} | {count} | {'; '.join(reasons) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--captions", choices=["short", "full"], default="full")
    parser.add_argument("--mixture-tokens", type=int, default=16)
    parser.add_argument("--models", default=",".join(LABEL.values()), help="comma-separated, e.g. CLIP,PCME++")
    parser.add_argument("--label", default="after", help="which table of the section this run writes: before | after")
    parser.add_argument("--quick", action="store_true", help="print only")
    parser.add_argument("--no-graph-breaks", action="store_true", help="skip the torch._dynamo.explain table")
    args = parser.parse_args(argv)
    wanted = {w.strip() for w in args.models.split(",")}
    names = [n for n in LABEL if LABEL[n] in wanted]
    counts = {}
    for n in names:
        counts[n] = count_step(n, SIZES[args.size], args.batch, args.captions, args.mixture_tokens)
        print(f"{LABEL[n]}: {counts[n].ops} ops, {counts[n].kernels} kernels, syncs {dict(counts[n].syncs)}",
              flush=True)
    body = (table(counts) + "\n\nHost syncs, where:\n\n" + sync_lines(counts)
            + "\n\nKernels beyond the baseline's, by op:\n\n" + top_ops(counts))
    if not args.no_graph_breaks:
        body += "\n\n" + graph_break_table(names)
    print(body)
    if args.quick:
        return
    write(args.label, body, argv)


INTRO = """\
A step's cost beyond its arithmetic, counted on the CPU: one full training step as `benchmarks/train_step.py`
times it (forward with ProLIP's masked copies / PCME++'s MSDA, backward, fused AdamW), b16 backbone, batch 256,
full captions, Llip mixture tokens 16, float32, under a `TorchDispatchMode` that sees every aten op. **ops**: aten ops
dispatched on the device; **kernels**: those that are not views or allocations (a proxy for GPU kernel launches; AdamW
is the trainer's fused kernel, one op). **host syncs**: data-dependent ops (`_local_scalar_dense` i.e. `.item()` /
`int()` / `bool()` of a tensor, `nonzero`, boolean-mask indexing, anything torch tags `data_dependent_output` or
`dynamic_output_shape`), copies from the device to the host, and blocking copies from the host (torch ends those in
`cudaStreamSynchronize`), each named by the project file:line of the Python stack at the op. **bytes**: input + output
nbytes per op, for pointwise and reduction ops (torch's tags), other memory-bound ops (copies, cat, indexing, sort,
norms, softmax) and, separately, matmul / convolution / attention and the AdamW step.

How, at this size on a 2-core CPU: the counted step runs on the `meta` device (shapes only, no arithmetic), with
`F.scaled_dot_product_attention` routed to the fused attention op a real step uses. Its data-dependent values (the text
trim's length, the masked rows, MSDA's CutMix branch) come from a real CPU step with the same batch, image, patches and
context but 32-wide 2-block towers (no random draw depends on the width), seeded alike and replayed in order. On meta
every model tensor stands for a GPU tensor while host-side tensors (AdamW's step counters, GPO's lengths) stay on the
CPU, so a sync counted there is one a GPU step takes. Caveats: float32 (bf16 autocast would halve the towers' bytes,
not the float32 heads' and losses'); GPO's GRU is counted as the CPU runs it, an op chain per time step: on a GPU cuDNN
runs it as one aten op per direction and pass, but still launches kernels per time step."""


NOTES = """\
### What changed between the tables, and what the counts predict on a GPU

Removed from the step (math unchanged: eager draws and random state bitwise as before, the GPO pooling equal to the
four separate GRU passes to 1e-14 in float64): ProLIP's and ProLIP-Llip's `nonzero` of the masked rows (the whole
batch's rows are known where they are drawn); PCME++'s CutMix branch read on the device (its coin is drawn on the host),
its Beta draws' and coin's blocking copies to the device, GPO's packing (sorted on the device, its inverse permutation
copied to the host) and its masks' blocking copies; ProLIP's three inclusion terms are one elementwise pass over their
rows together (-244 kernels), PML's two BCE terms share one softplus; off the CPU (a GPU; meta here), PCME++'s four
GPOs take their pooling weights from one GRU pass (block-diagonal recurrent weights over the union of the lengths):
197 sequential GRU steps per direction instead of 2 x 197 + 2 x 64 (on a CPU the GPOs keep their own passes, where
the joint one would only grow what autograd keeps per step). The one sync left in every method, the baselines too, is the text
trim (the batch's longest caption, read before any tower's work is queued); compiled, the trim is skipped (padding
masked instead).

A simple count model, GPU step = counted arithmetic + ~5 us per extra kernel + extra memory-bound bytes (bf16: about
half the float32 counts) at ~3 TB/s, reproduces Llip's measured 1.103x (1.073x arithmetic + 288 kernels + ~9 GB:
~1.107x) and under-reads ProLIP (1.116x vs 1.165x) and ProLIP-Llip (1.23x vs 1.299x). Applied as deltas to the H100
ratios: ProLIP ~1.15x (244 fewer kernels, one sync fewer), PCME++ ~1.5x (cuDNN runs the GRU per time step, ~5
kernels per step and direction forward + backward: ~3,200 fewer kernels, 10 syncs fewer), Llip ~1.10x (unchanged),
ProLIP-Llip ~1.28x. PCME++ stays far from 1.15x: the same model puts its remaining GRU chain at ~10 ms and leaves
~0.25x of its H100 step unexplained by the counts (only a GPU trace can say what it is). One H200 run (2026-11-28, `train_step_gpu`) measured
ProLIP 1.106x, PCME++ 1.457x, Llip 1.089x, ProLIP-Llip 1.225x, and its trace puts PCME++'s rest in the GRU pass (the reading
under that section)."""


def write(label: str, body: str, argv: list[str] | None) -> None:
    """The section keeps a "before" and an "after" table: a run replaces its own and leaves the other."""
    from benchmarks.report import DOC, write_section

    command = " ".join(argv if argv is not None else sys.argv[1:])
    tables = {}
    import re
    text = DOC.read_text() if DOC.exists() else ""
    for part in ("before", "after"):
        m = re.search(rf"<!-- step_counts_{part}:begin -->\n(.*?)\n<!-- step_counts_{part}:end -->", text, re.S)
        tables[part] = m.group(1) if m else "(not run yet)"
    run = " ".join(["python -m benchmarks.step_counts", command]).strip()
    tables[label] = f"Command: `{run}`; torch {torch.__version__}.\n\n{body}"
    section = ("## Step counts: ops, host syncs and memory-bound bytes per training step (`benchmarks/step_counts.py`)\n\n"
               + INTRO + "\n\n"
               + "".join(f"### {part.capitalize()}\n\n<!-- step_counts_{part}:begin -->\n{tables[part]}\n"
                         f"<!-- step_counts_{part}:end -->\n\n" for part in ("before", "after"))
               + NOTES)
    write_section("step_counts", section)


if __name__ == "__main__":
    main()
