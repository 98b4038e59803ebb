"""LoRA step time and peak memory with the frozen base in bf16, quanto qfloat8, torchao int8_w8a8 (the old
transposed form with its unfused epilogue, and the fused TN form) and float8_w8a8, side by side in one
process on one machine.

    python benchmarks/quantized_step.py --device cuda --families qwen_image --out /tmp/quant.md --time-budget 90
    OMP_NUM_THREADS=2 python benchmarks/quantized_step.py --device cpu         # tiny models, ~2 min
    OMP_NUM_THREADS=2 python benchmarks/quantized_step.py --device cpu --layer-width 1024 --resolution 512

Two parts, each row written the moment it is measured (the markdown file is rewritten with every row
so far, and one JSON line per row is appended to ``FILE.jsonl`` and printed):

* **layer**: one linear layer forward + input-gradient backward under bf16 autocast, one row per weight
  format: a bf16 ``nn.Linear``, quanto's qfloat8 ``QLinear``, and ``QuantizedLinear``
  (``trainer/model/quantized_linear.py``) with int8 weights on the old transposed kernel
  (``int8_w8a8_old``: ``(q @ xq.T).T``, then a contiguous fp32 copy and two in-place scale multiplies, what
  the layer ran before the TN form, and what it still runs where a device's check finds the TN layout
  wrong), on the fused TN kernel (``int8_w8a8``) and with fp8 weights (``float8_w8a8``, ``torch._scaled_mm``).
  At the widths of the family's attention projection and MLP up-projection and the tokens of one sample at
  ``--resolution``; eager, and compiled too on CUDA (with ``--compile on``: compiled only). Each row also
  has its relative error against fp32 for the output and the input gradient (the check that the device's
  kernel returns right numbers) and the kernel the layer ran; *x bf16* divides by the bf16 row.
* **model**: ``--steps`` LoRA steps of each family's transformer (random weights, ``benchmarks/harness.py``:
  full size on a GPU, the tiny architecture on the CPU) set up by the engine's own
  ``prepare_transformer`` with each weight format, bf16 autocast, gradient checkpointing as the
  low-memory profiles run it; s/step is the median after two warm-up steps. Peak memory: on CUDA
  ``max_memory_allocated`` over the steps (train) and over the build (load); on the CPU the process's
  peak RSS over the steps (``VmHWM``, reset before each run). *Weights* (MiB) is the bytes of the frozen
  transformer's tensors (8-bit data and scales included). *8-bit mm/step* counts ``torch._int_mm`` and
  ``torch._scaled_mm`` calls per step (eager only): nonzero shows an 8-bit kernel ran instead of the
  dequantized fallback.

``--time-budget S``: a measurement starts only if the time left covers the longest one of its part so
far (the first of each part starts if any time is left); skipped rows say so. A started measurement
runs to its end (a model build cannot be cut short), so the budget can be overrun by at most one row:
give the caller's limit some slack, and order ``--formats`` by importance (bf16 first: the ratios
divide by it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from trainer.model.block_swap import inner_tensors  # noqa: E402
from trainer.families import SPECS  # noqa: E402
from benchmarks.report_sections import quiet_logs  # noqa: E402
import trainer.model.quantized_linear as ql  # noqa: E402
from trainer.model.quantization import QuantizationChoice, quantize_module  # noqa: E402
from utils.memory_monitor import get_memory_stats, reset_peak_memory_stats  # noqa: E402

TORCHAO = ("quantize=true", "quantization.backend=torchao")
FORMATS: Dict[str, Tuple[str, ...]] = {
    "bf16": (),
    "int8_w8a8_old": TORCHAO + ("quantization.weights=int8_w8a8",),  # run with the transposed kernel forced
    "int8_w8a8": TORCHAO + ("quantization.weights=int8_w8a8",),
    "float8_w8a8": TORCHAO + ("quantization.weights=float8_w8a8",),
    "qfloat8": ("quantize=true", "quantization.backend=quanto", "quantization.weights=qfloat8"),
}
OLD_INT8 = "int8_w8a8_old"


@contextlib.contextmanager
def kernel_as_run(fmt: str, device: torch.device) -> Iterator[None]:
    """``int8_w8a8_old``: the device's int8 check answered with the old transposed kernel while active (as a
    device whose TN layout is wrong); the other formats as they are."""
    if fmt != OLD_INT8:
        yield
        return
    key = (ql.INT8, device.type, device.index)
    ql.kernel_check(device, ql.INT8)
    saved = ql._CHECKS[key]
    ql._CHECKS[key] = ql.KernelCheck(ql.INT8_TRANSPOSED, "benchmark: the old transposed form") \
        if saved.kernel != ql.DEQUANTIZED else saved
    try:
        yield
    finally:
        ql._CHECKS[key] = saved


@dataclass
class Row:
    """One measurement (a JSON line)."""

    part: str  # layer | model
    family: str
    format: str
    compile: str
    status: str = "ok"  # ok | skipped: ... | failed: ...
    values: Dict[str, Any] = field(default_factory=dict)


class Budget:
    """``--time-budget``: a deadline, and the longest measurement of each part so far."""

    def __init__(self, seconds: Optional[float]):
        self.deadline = time.monotonic() + seconds if seconds is not None else None
        self.longest: Dict[str, float] = {}

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def allows(self, part: str, extra_s: float = 0.0) -> bool:
        return self.left() > self.longest.get(part, 0.0) + extra_s

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.longest[part] = max(self.longest.get(part, 0.0), time.monotonic() - start)


# =========================================================================== layer part


def layer_shapes(family: str, scale: harness.Scale, resolution: int,
                 width: Optional[int] = None) -> List[Tuple[str, int, int, int]]:
    """(name, tokens, in, out): the family's attention projection and MLP up-projection (at ``width`` when
    given, else the family's at ``scale``), for the image tokens of one sample at ``resolution``."""
    config = harness.transformer_config(family, scale)
    width = width or config["num_attention_heads"] * config["attention_head_dim"]
    tokens = (resolution // 16) ** 2  # 8x VAE, 2x2 patches
    return [("attention q", tokens, width, width), ("MLP up", tokens, width, 4 * width)]


def time_fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: torch.device,
                 repeats: int) -> float:
    """Median seconds of ``fn(x).backward(grad)`` after two warm-up calls."""
    grad = torch.randn_like(fn(x))
    times = []
    for i in range(repeats + 2):
        x.grad = None
        harness._sync(device)
        start = time.perf_counter()
        fn(x).backward(grad)
        harness._sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def quantized_layer(fmt: str, plain: torch.nn.Linear) -> torch.nn.Module:
    """A copy of the bf16 ``plain`` layer with its weight in ``fmt`` (bf16: the copy as it is)."""
    layer = torch.nn.Linear(plain.in_features, plain.out_features, device=plain.weight.device, dtype=plain.weight.dtype)
    layer.load_state_dict(plain.state_dict())
    layer.requires_grad_(False)
    if fmt == "bf16":
        return layer
    wrapper = torch.nn.Sequential(layer)  # quanto quantizes a module's children
    backend, weights = ("quanto", "qfloat8") if fmt == "qfloat8" else ("torchao", fmt.replace("_old", ""))
    quantize_module(wrapper, QuantizationChoice(backend, weights))
    return wrapper


def layer_kernel(fmt: str, module: torch.nn.Module, device: torch.device) -> str:
    """The matmul the layer runs: the 8-bit kernel or its dequantized fallback (torchao), quanto's, bf16."""
    if fmt in ("bf16", "qfloat8"):
        return {"bf16": "bf16 matmul", "qfloat8": "quanto"}[fmt]
    weight = module[0].weight
    return ql.choose_kernel(device, ql.storage_format(weight.qdata), weight.shape)


def measure_layer(fmt: str, name: str, tokens: int, d_in: int, d_out: int, device: torch.device, compiled: bool,
                  repeats: int) -> Dict[str, Any]:
    """One weight format's layer, forward + input gradient, under bf16 autocast as in training; its error
    against fp32 (the bf16 weight multiplied in fp32)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(d_in, d_out, device=device, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    with kernel_as_run(fmt, device):
        module = quantized_layer(fmt, plain)
        values: Dict[str, Any] = {"layer": name, "tokens": tokens, "in": d_in, "out": d_out,
                                  "kernel": layer_kernel(fmt, module, device)}
        x32 = x.detach().float().requires_grad_()
        want = torch.nn.functional.linear(x32, plain.weight.float(), plain.bias.float())
        grad = torch.randn_like(want)
        want.backward(grad)
        xq = x.detach().clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            got = module(xq)
        got.backward(grad.to(got.dtype))
        values.update(out_error=rel_error(got, want), grad_error=rel_error(xq.grad, x32.grad))
        fn = torch.compile(module) if compiled else module

        def step(inp: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return fn(inp)

        values["ms"] = 1e3 * time_fwd_bwd(step, x, device, repeats)
    return values


# =========================================================================== model part


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the frozen weights and buffers (a quantized weight's data and scales)."""
    tensors = [t for p in model.parameters() if not p.requires_grad for t in inner_tensors(p)]
    tensors += list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def counting_8bit_mm() -> Iterator[List[int]]:
    """Counts ``torch._int_mm`` and ``torch._scaled_mm`` calls while active."""
    calls: List[int] = []
    real = {name: getattr(torch, name) for name in ("_int_mm", "_scaled_mm")}

    def counted(name: str) -> Callable[..., torch.Tensor]:
        return lambda *a, **kw: calls.append(1) or real[name](*a, **kw)

    for name in real:
        setattr(torch, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)


def measure_model(family: str, fmt: str, args: argparse.Namespace, device: torch.device,
                  scale: harness.Scale) -> Dict[str, Any]:
    overrides = list(FORMATS[fmt]) + [f"compile={'true' if args.compile == 'on' else 'false'}"]
    if args.compile == "on" and fmt == "qfloat8":
        overrides[-1] = "compile=false"  # quanto's kernels cannot be traced (the engine's auto leaves it eager)
    gc.collect()
    with kernel_as_run(fmt, device):
        rig = harness.build_rig(family, device, torch.bfloat16, scale=scale, checkpointing=not args.no_checkpointing,
                                overrides=overrides, resolution=args.resolution)
        try:
            values: Dict[str, Any] = {"build_s": rig.build_seconds, "compiled": rig.compiled,
                                      "weights_mib": frozen_bytes(rig.transformer) / 2**20,
                                      "load_peak_gib": rig.load_peak_gib}
            if device.type == "cpu":  # the host is the device: its peak RSS over the steps (VmHWM, reset)
                reset_peak_memory_stats(host=True)
            with counting_8bit_mm() as calls:
                report = harness.run_steps(rig, args.steps, args.resolution)
            values.update(s_per_step=report.median_step_s, steps=len(report.steady_times),
                          first_step_s=report.step_times[0], train_peak_gib=report.peak_gib,
                          reserved_gib=report.reserved_gib, loss_first=report.losses[0],
                          loss_last=report.losses[-1], finite=report.finite, image_tokens=report.image_tokens,
                          text_tokens=report.text_tokens,
                          mm8_per_step=None if rig.compiled else len(calls) / args.steps)
            if device.type == "cpu":
                values["train_peak_gib"] = get_memory_stats().get("host_peak_rss_gib")
            return values
        finally:
            rig.free()
            gc.collect()


# =========================================================================== output


class Output:
    """The markdown file (rewritten with each row) and its JSON lines (appended, and printed)."""

    def __init__(self, path: Path, header: str):
        self.path, self.header, self.rows = path, header, []
        self.jsonl = path.with_name(path.name + ".jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        self.write()

    def add(self, row: Row) -> None:
        self.rows.append(row)
        line = json.dumps(asdict(row), default=str)
        with self.jsonl.open("a") as fh:
            fh.write(line + "\n")
        print(line, flush=True)
        self.write()

    def write(self) -> None:
        self.path.write_text(self.header + layer_table(self.rows) + model_table(self.rows))


def fmt(value: Optional[float], spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def layer_table(rows: List[Row]) -> str:
    layers = [r for r in rows if r.part == "layer"]
    base = {(r.family, r.values.get("layer"), r.compile): r.values for r in layers
            if r.format == "bf16" and r.status == "ok"}
    body = []
    for r in layers:
        v = r.values
        if r.status != "ok":
            body.append((r.family, v.get("layer", ""), r.format, r.compile, r.status, "", "", "", ""))
            continue
        ref = base.get((r.family, v["layer"], r.compile))
        body.append((r.family, f"{v['layer']} ({v['tokens']} x {v['in']} -> {v['out']})", r.format, r.compile,
                     fmt(v["ms"], ".2f"), fmt(v["ms"] / ref["ms"], ".2f") if ref else "n/a", v["kernel"],
                     fmt(100 * v["out_error"], ".2f"), fmt(100 * v["grad_error"], ".2f")))
    if not body:
        return ""
    return ("\n## One linear layer: forward + input gradient (ms)\n\n"
            + table(("Family", "Layer (tokens x in -> out)", "Weights", "Compile", "ms", "x bf16", "Kernel",
                     "out error %", "grad error %"), body))


def model_table(rows: List[Row]) -> str:
    models = [r for r in rows if r.part == "model"]
    if not models:
        return ""
    base = {(r.family, r.compile): r.values for r in models if r.format == "bf16" and r.status == "ok"}
    body = []
    for r in models:
        v = r.values
        if r.status != "ok":
            body.append((SPECS[r.family].title, r.format, r.compile, r.status, *[""] * 9))
            continue
        ref = base.get((r.family, r.compile))
        ratio = lambda key: fmt(v[key] / ref[key], ".2f") if ref and v.get(key) and ref.get(key) else "n/a"  # noqa: E731
        mm = v["mm8_per_step"]
        body.append((SPECS[r.family].title, r.format, f"{r.compile} ({'compiled' if v['compiled'] else 'eager'})",
                     fmt(v["s_per_step"]), ratio("s_per_step"), fmt(v["train_peak_gib"], ".2f"),
                     ratio("train_peak_gib"), fmt(v["load_peak_gib"], ".2f"), fmt(v["weights_mib"], ".1f"),
                     "n/a" if mm is None else f"{mm:.0f}", f"{v['loss_first']:.4f} -> {v['loss_last']:.4f}",
                     fmt(v["first_step_s"], ".1f"), fmt(v["build_s"], ".1f")))
    return ("\n## LoRA steps (s/step, GiB)\n\n"
            + table(("Family", "Weights", "Compile", "s/step", "x bf16", "Train peak", "x bf16", "Load peak",
                     "Weights MiB", "8-bit mm/step", "Loss", "First step s", "Build s"), body))


def header(args: argparse.Namespace, device: torch.device, scale: harness.Scale, argv: List[str]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "full-size random-weight transformers" if scale.name == "full" else f"the {scale.name} architecture"
    peak = "`torch.cuda.max_memory_allocated`" if device.type == "cuda" else "peak RSS of the process (VmHWM)"
    return (f"# Quantized LoRA step: bf16 vs qfloat8 vs int8_w8a8 (old, fused) vs float8_w8a8\n\n"
            f"Written by `python benchmarks/quantized_step.py {' '.join(argv)}` on {when}, "
            f"{harness.device_name(device)}, torch {torch.__version__}. {what}, {args.resolution}^2, batch 1, "
            f"LoRA (the family's `attention` preset, rank 16), AdamW, bf16 autocast, gradient checkpointing "
            f"{'off' if args.no_checkpointing else 'on'}, compile {args.compile}. Memory: {peak}. "
            f"*x bf16* divides by the bf16 row of the same family.\n")


# =========================================================================== main


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", nargs="+", choices=harness.FAMILIES, default=["qwen_image"])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS),
                        help="weight formats, measured in this order (bf16 first: the ratios need it)")
    parser.add_argument("--steps", type=int, default=None, help="steps per model run (default 8 CUDA, 6 CPU)")
    parser.add_argument("--resolution", type=int, default=None, help="image side (default 1024 CUDA, 64 CPU)")
    parser.add_argument("--scale", choices=sorted(harness.SCALES), default=None,
                        help="model size (default full on CUDA, tiny on the CPU)")
    parser.add_argument("--compile", choices=("off", "on"), default="off",
                        help="torch.compile the blocks (qfloat8 stays eager, as the engine leaves it) and the layers")
    parser.add_argument("--layer-width", type=int, default=None, metavar="N",
                        help="the layer part at this width (N -> N and N -> 4N) instead of the model's: a CPU run "
                             "between the tiny model (overhead only) and the full width (minutes per call where "
                             "bf16 is emulated)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
    parser.add_argument("--parts", nargs="+", choices=("layer", "model"), default=["layer", "model"])
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="skip what cannot finish within this many seconds from the start")
    parser.add_argument("--out", type=Path, default=ROOT / "output" / "quantized_step.md",
                        help="markdown file; its JSON lines go to FILE.jsonl")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.steps = args.steps or (8 if cuda else 6)
    args.resolution = args.resolution or (1024 if cuda else 64)
    args.scale = args.scale or ("full" if cuda else "tiny")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"{harness.no_cuda_reason()}\nUse --device cpu for the tiny models.")
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (two warm-up steps, then timed ones)")
    return args


def main(argv: Optional[List[str]] = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    budget = Budget(args.time_budget)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    scale = harness.SCALES[args.scale]
    out = Output(args.out, header(args, device, scale, argv))
    for row, measure, extra_s in plan_rows(args, device, scale):
        run_one(out, budget, row, measure, extra_s)
    print(f"wrote {out.path} and {out.jsonl}")
    return out.path


Measurement = Tuple[Row, Callable[[], Dict[str, Any]], float]  # the row, what fills it, known extra seconds


def plan_rows(args: argparse.Namespace, device: torch.device, scale: harness.Scale) -> List[Measurement]:
    """What to measure, most telling first (a time budget skips from the end): the eager layers, the
    bf16 and torchao steps, the compiled layers (on CUDA with triton: one layer compiles in seconds), then
    qfloat8 (whose first use on a GPU may build quanto's extension)."""
    layer_modes = ["on"] if args.compile == "on" else ["off"]
    if device.type == "cuda" and args.compile == "off" and has_triton():
        layer_modes.append("on")
    first, later = [], []
    for family in args.families:
        for mode in layer_modes if "layer" in args.parts else []:
            for name, tokens, d_in, d_out in layer_shapes(family, scale, args.resolution, args.layer_width):
                for fmt_name in args.formats:
                    row = Row("layer", family, fmt_name, mode, values={"layer": name})
                    measure = functools.partial(measure_layer, fmt_name, name, tokens, d_in, d_out, device,
                                                mode == "on", 10)
                    extra = QUANTO_BUILD_S if fmt_name == "qfloat8" and quanto_build_pending(device) else 0.0
                    (first if mode == layer_modes[0] and fmt_name != "qfloat8" else later).append((row, measure, extra))
        for fmt_name in args.formats if "model" in args.parts else []:
            extra = QUANTO_BUILD_S if fmt_name == "qfloat8" and quanto_build_pending(device) else 0.0
            measure = functools.partial(measure_model, family, fmt_name, args, device, scale)
            (later if fmt_name == "qfloat8" else first).append((Row("model", family, fmt_name, args.compile),
                                                                measure, extra))
    return first + later


def has_triton() -> bool:
    from torch.utils._triton import has_triton as available

    return available()


QUANTO_BUILD_S = 120  # quanto compiles its CUDA extension on first use: about 100 s on an H100


def quanto_build_pending(device: torch.device) -> bool:
    """Whether quanto would compile its CUDA extension first (none built for this torch yet)."""
    if device.type != "cuda":
        return False
    from optimum.quanto.library.extensions import get_extension

    try:
        version = Path(get_extension("quanto_cuda").build_directory) / "pytorch_version.txt"
    except KeyError:  # not a CUDA build of torch: quanto registered no CUDA extension
        return False
    return not (version.is_file() and version.read_text().strip() == torch.__version__)


def run_one(out: Output, budget: Budget, row: Row, measure: Callable[[], Dict[str, Any]], extra_s: float = 0.0) -> None:
    """Measure one row unless the budget is spent (``extra_s``: known extra time of this row); a
    failure is a row too (the next one still runs)."""
    if not budget.allows(row.part, extra_s):
        why = f", and quanto's CUDA extension is not built yet (~{QUANTO_BUILD_S} s)" if extra_s else ""
        row.status = f"skipped: time budget ({max(budget.left(), 0):.0f} s left{why})"
    else:
        with budget.timing(row.part):
            try:
                row.values.update(measure())
            except torch.cuda.OutOfMemoryError:
                row.status = "failed: out of memory"
            except Exception as exc:  # one row's failure must not cost the others
                row.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    out.add(row)


if __name__ == "__main__":
    quiet_logs()
    main()
