"""LoRA step time and peak memory with the frozen base in bf16, quanto qfloat8 and torchao int8_w8a8,
side by side in one process on one machine.

    python benchmarks/quantized_step.py --device cuda --families qwen_image --out /tmp/quant.md --time-budget 90
    OMP_NUM_THREADS=2 python benchmarks/quantized_step.py --device cpu         # tiny models, ~1 min

Two parts, each row written the moment it is measured (the markdown file is rewritten with every row
so far, and one JSON line per row is appended to ``FILE.jsonl`` and printed):

* **layer**: one linear layer forward + input-gradient backward, bf16 ``nn.Linear`` against
  ``Int8Linear`` (``trainer/model/int8_linear.py``), at the widths of the family's attention projection and
  MLP up-projection and the tokens of one sample at ``--resolution``; eager, and compiled too on
  CUDA (with ``--compile on``: compiled only). Also the int8 layer's relative error against fp32 on this device, for the output
  and the input gradient (the check that the device's int8 kernel returns right numbers).
* **model**: ``--steps`` LoRA steps of each family's transformer (random weights, ``tests/gpu/harness.py``:
  full size on a GPU, the tiny architecture on the CPU) set up by the engine's own
  ``prepare_transformer`` with each weight format, bf16 autocast, gradient checkpointing as the
  low-memory profiles run it; s/step is the median after two warm-up steps. Peak memory: on CUDA
  ``max_memory_allocated`` over the steps (train) and over the build (load); on the CPU the process's
  peak RSS over the steps (``VmHWM``, reset before each run). *Weights* (MiB) is the bytes of the frozen
  transformer's tensors (int8 data and scales included). *int8 mm/step* counts ``torch._int_mm``
  calls per step (eager only): nonzero shows the int8 path ran instead of the dequantized fallback.

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
for _path in (ROOT, ROOT / "tests" / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import harness  # noqa: E402
from trainer.model.block_swap import inner_tensors  # noqa: E402
from trainer.families import SPECS  # noqa: E402
from benchmarks.gpu_report import quiet_logs  # noqa: E402
from trainer.model.int8_linear import int8_matmul_refusal, int8_matmul_works, quantize_int8_w8a8  # noqa: E402
from utils.memory_monitor import get_memory_stats, reset_peak_memory_stats  # noqa: E402

FORMATS: Dict[str, Tuple[str, ...]] = {
    "bf16": (),
    "int8_w8a8": ("quantize=true", "quantization.backend=torchao", "quantization.weights=int8_w8a8"),
    "qfloat8": ("quantize=true", "quantization.backend=quanto", "quantization.weights=qfloat8"),
}


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


def layer_shapes(family: str, scale: harness.Scale, resolution: int) -> List[Tuple[str, int, int, int]]:
    """(name, tokens, in, out): the family's attention projection and MLP up-projection, for the image
    tokens of one sample at ``resolution``."""
    config = harness.transformer_config(family, scale)
    width = config["num_attention_heads"] * config["attention_head_dim"]
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


def measure_layer(name: str, tokens: int, d_in: int, d_out: int, device: torch.device, compiled: bool,
                  repeats: int) -> Dict[str, Any]:
    """bf16 Linear vs Int8Linear, forward + input gradient, under bf16 autocast as in training."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(d_in, d_out, device=device, dtype=torch.bfloat16).requires_grad_(False)
    int8 = torch.nn.Linear(d_in, d_out, device=device, dtype=torch.bfloat16)
    int8.load_state_dict(plain.state_dict())
    quantize_int8_w8a8(int8)
    x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    values: Dict[str, Any] = {"layer": name, "tokens": tokens, "in": d_in, "out": d_out,
                              "int8_kernel": int8_matmul_works(device),
                              "int8_refusal": int8_matmul_refusal(device)}
    # Accuracy against fp32 (the weight as stored in bf16, multiplied in fp32).
    ref_w, ref_b = plain.weight.float(), plain.bias.float()
    x32 = x.detach().float().requires_grad_()
    want = torch.nn.functional.linear(x32, ref_w, ref_b)
    grad = torch.randn_like(want)
    want.backward(grad)
    xq = x.detach().clone().requires_grad_()
    got = int8(xq)
    got.backward(grad.to(got.dtype))
    values.update(out_error=rel_error(got, want), grad_error=rel_error(xq.grad, x32.grad))
    for label, module in (("bf16", plain), ("int8", int8)):
        fn = torch.compile(module) if compiled else module

        def step(inp: torch.Tensor, fn: Callable = fn) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return fn(inp)

        values[f"{label}_ms"] = 1e3 * time_fwd_bwd(step, x, device, repeats)
    values["int8_vs_bf16"] = values["int8_ms"] / values["bf16_ms"]
    return values


# =========================================================================== model part


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the frozen weights and buffers (a quantized weight's data and scales)."""
    tensors = [t for p in model.parameters() if not p.requires_grad for t in inner_tensors(p)]
    tensors += list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def counting_int_mm() -> Iterator[List[int]]:
    """Counts ``torch._int_mm`` calls while active."""
    calls: List[int] = []
    real = torch._int_mm

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(a, b)

    torch._int_mm = counted
    try:
        yield calls
    finally:
        torch._int_mm = real


def measure_model(family: str, fmt: str, args: argparse.Namespace, device: torch.device,
                  scale: harness.Scale) -> Dict[str, Any]:
    overrides = list(FORMATS[fmt]) + [f"compile={'true' if args.compile == 'on' else 'false'}"]
    if args.compile == "on" and fmt == "qfloat8":
        overrides[-1] = "compile=false"  # quanto's kernels cannot be traced (the engine's auto leaves it eager)
    gc.collect()
    rig = harness.build_rig(family, device, torch.bfloat16, scale=scale, checkpointing=not args.no_checkpointing,
                            overrides=overrides, resolution=args.resolution)
    try:
        values: Dict[str, Any] = {"build_s": rig.build_seconds, "compiled": rig.compiled,
                                  "weights_mib": frozen_bytes(rig.transformer) / 2**20, "load_peak_gib": rig.load_peak_gib}
        if device.type == "cpu":  # the host is the device: its peak RSS over the steps (VmHWM, reset)
            reset_peak_memory_stats(host=True)
        with counting_int_mm() as calls:
            report = harness.run_steps(rig, args.steps, args.resolution)
        values.update(s_per_step=report.median_step_s, steps=len(report.steady_times),
                      first_step_s=report.step_times[0], train_peak_gib=report.peak_gib,
                      reserved_gib=report.reserved_gib, loss_first=report.losses[0], loss_last=report.losses[-1],
                      finite=report.finite, image_tokens=report.image_tokens, text_tokens=report.text_tokens,
                      int8_mm_per_step=None if rig.compiled else len(calls) / args.steps)
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
    body = []
    for r in (r for r in rows if r.part == "layer"):
        v = r.values
        if r.status != "ok":
            body.append((r.family, v.get("layer", ""), r.compile, r.status, "", "", "", "", ""))
            continue
        body.append((r.family, f"{v['layer']} ({v['tokens']} x {v['in']} -> {v['out']})", r.compile,
                     fmt(v["bf16_ms"], ".2f"), fmt(v["int8_ms"], ".2f"), fmt(v["int8_vs_bf16"], ".2f"),
                     "yes" if v["int8_kernel"] else f"**no** (dequantized fallback: {v.get('int8_refusal') or 'refused'})",
                     fmt(100 * v["out_error"], ".2f"), fmt(100 * v["grad_error"], ".2f")))
    if not body:
        return ""
    return ("\n## One linear layer: forward + input gradient (ms)\n\n"
            + table(("Family", "Layer (tokens x in -> out)", "Compile", "bf16 ms", "int8 ms", "int8 / bf16",
                     "int8 kernel", "out error %", "grad error %"), body))


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
        mm = v["int8_mm_per_step"]
        body.append((SPECS[r.family].title, r.format, f"{r.compile} ({'compiled' if v['compiled'] else 'eager'})",
                     fmt(v["s_per_step"]), ratio("s_per_step"), fmt(v["train_peak_gib"], ".2f"),
                     ratio("train_peak_gib"), fmt(v["load_peak_gib"], ".2f"), fmt(v["weights_mib"], ".1f"),
                     "n/a" if mm is None else f"{mm:.0f}", f"{v['loss_first']:.4f} -> {v['loss_last']:.4f}",
                     fmt(v["first_step_s"], ".1f"), fmt(v["build_s"], ".1f")))
    return ("\n## LoRA steps (s/step, GiB)\n\n"
            + table(("Family", "Weights", "Compile", "s/step", "x bf16", "Train peak", "x bf16", "Load peak",
                     "Weights MiB", "int8 mm/step", "Loss", "First step s", "Build s"), body))


def header(args: argparse.Namespace, device: torch.device, scale: harness.Scale, argv: List[str]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "full-size random-weight transformers" if scale.name == "full" else f"the {scale.name} architecture"
    peak = "`torch.cuda.max_memory_allocated`" if device.type == "cuda" else "peak RSS of the process (VmHWM)"
    return (f"# Quantized LoRA step: bf16 vs qfloat8 vs int8_w8a8\n\n"
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
    bf16 and int8 steps, the compiled layers (on CUDA with triton: one layer compiles in seconds), then
    qfloat8 (whose first use on a GPU may build quanto's extension)."""
    layer_modes = ["on"] if args.compile == "on" else ["off"]
    if device.type == "cuda" and args.compile == "off" and has_triton():
        layer_modes.append("on")
    first, later = [], []
    for family in args.families:
        for mode in layer_modes if "layer" in args.parts else []:
            for name, tokens, d_in, d_out in layer_shapes(family, scale, args.resolution):
                row = Row("layer", family, "int8_w8a8", mode, values={"layer": name})
                measure = functools.partial(measure_layer, name, tokens, d_in, d_out, device, mode == "on", 10)
                (first if mode == layer_modes[0] else later).append((row, measure, 0.0))
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
