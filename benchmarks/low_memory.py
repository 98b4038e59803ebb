"""Peak memory and step time of the low-memory options, side by side, in one run.

Each configuration (frozen-weight format x gradient checkpointing x swapped blocks) is trained for a
few steps by a fresh ``train.py`` subprocess, so peaks never mix; the figures are read from the
engine's own log lines ("Memory peak ..." and "trained N steps in X s (Y s/step)").

    OMP_NUM_THREADS=1 python benchmarks/low_memory.py [--quick] [--out results.json]
    python benchmarks/low_memory.py --model /path/to/Qwen-Image --img-size 1024   # on a GPU

Without ``--model`` it builds a benchmark pipeline: the tiny Qwen-Image pipeline with a bigger random
transformer (6 blocks of 8 x 64-wide heads, 57M parameters, 220 MB in fp32; ``--stored-dtype bf16``
stores it in bf16 like the real checkpoint), large enough that weight memory stands out above the
Python/torch baseline. On a CPU the "device" is the host, so the memory figure is the host peak RSS;
on a GPU the engine also logs ``gpu_peak_allocated``, which becomes the main column. Ratios are to
the first row: bf16 frozen weights, checkpointing on, no swap. Results: docs/LOW_MEMORY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

BASE_CONFIG = "train_configs/quickstart_tiny.yaml"  # every key that matters is overridden below
DEFAULT_WORK = ROOT / "output" / "low_memory_bench"
# Benchmark transformer: the tiny pipeline's in/out channels and text width, bigger blocks.
BENCH_TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=6, attention_head_dim=64,
                         num_attention_heads=8, joint_attention_dim=16, axes_dims_rope=(16, 24, 24))
WEIGHTS = {  # frozen-weight format -> config overrides
    "bf16": ["quantize=false"],
    "qfloat8": ["quantize=true", "quantization.backend=quanto", "quantization.weights=qfloat8"],
    "qint4": ["quantize=true", "quantization.backend=quanto", "quantization.weights=qint4"],
    "ao-int8": ["quantize=true", "quantization.backend=torchao", "quantization.weights=int8_weight_only"],
}
# glibc keeps freed heap memory (quantization temporaries) in RSS unless large blocks are mmap'ed and
# returned at once; a device allocator's "allocated" figure counts live tensors only, so this makes the
# host figure the closer proxy. Shown in every printed command; --no-malloc-tuning turns it off.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIGURE = re.compile(r"(\w+)=([0-9.]+)GiB")
PHASE = re.compile(r"Memory peak '(\w+)' x\d+: ([^\r\n]*)")
OVERALL = re.compile(r"Memory peak overall: ([^\r\n]*)")
DEVICE = re.compile(r", device (\S+), \d+ process")
STEPS = re.compile(r"trained (\d+) steps in ([0-9.]+) s \(([0-9.]+) s/step\)")


@dataclass(frozen=True)
class Config:
    """One benchmark row: how the frozen weights are stored, checkpointing, swapped blocks, optimizer."""

    weights: str
    checkpointing: bool
    swap: int
    adam8bit: bool = False
    label: str = ""

    @property
    def name(self) -> str:
        """A folder-safe name, unique within the grid."""
        return f"{self.weights}_{'ckpt' if self.checkpointing else 'nockpt'}_swap{self.swap}" \
               + ("_adam8bit" if self.adam8bit else "")

    def overrides(self) -> List[str]:
        return [*WEIGHTS[self.weights], f"disable_gradient_checkpointing={str(not self.checkpointing).lower()}",
                f"blocks_to_swap={self.swap}", f"adam8bit={str(self.adam8bit).lower()}"]


@dataclass
class Result:
    """What one run measured (GiB and seconds), or why it failed."""

    config: Config
    command: str
    returncode: int
    wall_s: float  # the whole subprocess: start-up, cache pass, load, steps
    cpu_s: float  # its user + system CPU time: less disturbed than wall time by other load on the cores
    log: str
    device: str = ""  # as the engine names it: cpu, cuda, ...
    steps: Optional[int] = None
    s_per_step: Optional[float] = None  # wall, as the engine logs it
    cpu_s_per_step: Optional[float] = None  # CPU time of the training loop / steps (Linux)
    overall: Dict[str, float] = field(default_factory=dict)  # host_peak_rss, gpu_peak_allocated, ...
    phases: Dict[str, Dict[str, float]] = field(default_factory=dict)  # cache_pass, load_transformer, ...
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.s_per_step is not None and bool(self.overall)


# -- inputs --------------------------------------------------------------------------------------
def grid(quick: bool, swap: int) -> List[Config]:
    """The configurations to run; the first is the baseline (bf16 + checkpointing, no swap)."""
    base = Config("bf16", True, 0, label="baseline")
    if quick:
        return [base, Config("bf16", False, 0), Config("bf16", True, swap), Config("qfloat8", True, 0),
                Config("qint4", True, 0), Config("ao-int8", True, 0)]
    # Every format with and without checkpointing, and with swap (swap without checkpointing would
    # save memory on weights while keeping every activation: not a setting anyone would pick).
    rows = [base] + [Config(w, c, 0) for w in WEIGHTS for c in (True, False) if (w, c) != ("bf16", True)]
    rows += [Config(w, True, swap) for w in WEIGHTS]
    # The profiles as train_4090.py sets them (qfloat8, checkpointing, 8-bit AdamW), without/with swap.
    return rows + [Config("qfloat8", True, 0, True, "24 GB profile"),
                   Config("qfloat8", True, swap, True, "16 GB profile")]


def build_bench_pipeline(folder: Path, layers: int, dtype: str) -> Path:
    """The tiny Qwen-Image pipeline with its transformer replaced by a bigger random one, stored in
    ``dtype``. Reused when a previous run built the same one."""
    spec = {**BENCH_TRANSFORMER, "num_layers": layers}
    marker = folder / "benchmark_transformer.json"
    wanted = json.loads(json.dumps({**spec, "stored_dtype": dtype}))
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return folder
    import torch  # heavy imports only when building (the runs themselves are subprocesses)
    from diffusers import QwenImageTransformer2DModel

    from utils.tiny_models import build_tiny_pipeline

    build_tiny_pipeline("qwen_image", folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = QwenImageTransformer2DModel(**spec).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    marker.write_text(json.dumps(wanted))
    return folder


def transformer_config(model: Path) -> Dict:
    return json.loads((model / "transformer" / "config.json").read_text())


def make_dataset(folder: Path, size: int) -> Path:
    from image_datasets.sample_data import make_sample_dataset

    return make_sample_dataset(folder, size=size, count=2)  # two sizes (one landscape) is enough


# -- running -------------------------------------------------------------------------------------
def command(cfg: Config, model: Path, data: Path, out: Path, img_size: int, steps: int,
            extra_overrides: List[str]) -> List[str]:
    return [sys.executable, "train.py", "--config", BASE_CONFIG,
            f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
            f"data_config.img_size={img_size}", "data_config.train_batch_size=1", "data_config.num_workers=0",
            f"output_dir={out}", "overwrite_output_dir=true", "report_to=none", "seed=0",
            f"max_train_steps={steps}", "checkpointing_steps=1000000", "lr_warmup_steps=0", "learning_rate=1e-4",
            "mixed_precision=bf16", "rank=16", "lora_target=attention",
            # Caches in memory: every run encodes its own, so no run profits from another's files.
            "save_cache_on_disk=false", *cfg.overrides(), *extra_overrides]


def extra_env(malloc_tuning: bool) -> Dict[str, str]:
    """Variables set for every run (and printed with its command)."""
    extra = {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ}  # matters on a shared CPU
    return {**extra, **(MALLOC_ENV if malloc_tuning and sys.platform == "linux" else {})}


def child_env(extra: Dict[str, str]) -> Dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **extra}
    env.pop("ACCELERATE_MIXED_PRECISION", None)  # it would override mixed_precision=bf16
    return env


def shown(cmd: List[str], extra: Dict[str, str]) -> str:
    """The command as a shell line, run from the repository root."""
    return " ".join(f"{k}={v}" for k, v in extra.items()) + (" " if extra else "") + shlex.join(cmd)


def run(cfg: Config, cmd: List[str], extra: Dict[str, str], log_path: Path, timeout: int) -> Result:
    """Run one configuration to completion; its output goes to ``log_path`` and is parsed."""
    start, cpu_start = time.perf_counter(), _children_cpu()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(extra), stdout=log, stderr=subprocess.STDOUT)
        rc, loop_cpu = watch(proc, log_path, timeout)
    text = ANSI.sub("", log_path.read_text(errors="replace"))
    result = Result(cfg, shown(cmd, extra), rc, round(time.perf_counter() - start, 1),
                    round(_children_cpu() - cpu_start, 1), str(log_path))
    parse(text, result)
    if loop_cpu is not None and result.steps:
        result.cpu_s_per_step = round(loop_cpu / result.steps, 3)
    if not result.ok:
        result.error = "timed out" if rc == 124 else _last_error(text)
    return result


def watch(proc: subprocess.Popen, log_path: Path, timeout: int) -> Tuple[int, Optional[float]]:
    """Wait for ``proc``; return its exit code and the CPU seconds its training loop used.

    Wall time per step is at the mercy of whatever else runs on the cores; CPU time much less so. It
    is sampled from /proc (Linux) when the progress bar appears and when "trained N steps" is logged.
    """
    deadline, marks, tail = time.monotonic() + timeout, {}, ""
    with open(log_path, errors="replace") as reader:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                return 124, None
            tail = (tail + reader.read())[-4096:]  # markers may straddle two reads
            for mark, found in (("start", "training:" in tail), ("end", STEPS.search(tail) is not None)):
                if found and mark not in marks:
                    marks[mark] = _process_cpu(proc.pid)
            time.sleep(0.05)
    start, end = marks.get("start"), marks.get("end")
    return proc.returncode, None if start is None or end is None else end - start


def _process_cpu(pid: int) -> Optional[float]:
    """User + system CPU seconds of a running process, all threads (None off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _children_cpu() -> float:
    """CPU seconds used by finished children so far (runs are sequential, so a difference is one run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def parse(text: str, result: Result) -> None:
    """Fill ``result`` from the engine's log lines (progress bars share lines with them: unanchored)."""
    if match := DEVICE.search(text):
        result.device = match.group(1)
    if match := STEPS.search(text):
        result.steps, result.s_per_step = int(match.group(1)), float(match.group(3))
    if match := OVERALL.search(text):
        result.overall = figures(match.group(1))
    for name, rest in PHASE.findall(text):
        result.phases[name] = figures(rest)


def figures(text: str) -> Dict[str, float]:
    return {key: float(value) for key, value in FIGURE.findall(text)}


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:300]


# -- report --------------------------------------------------------------------------------------
def on_gpu(results: List[Result]) -> bool:
    return any(r.overall.get("gpu_peak_allocated", 0.0) > 0 for r in results)


def overall(key: str) -> Callable[[Result], Optional[float]]:
    return lambda r: r.overall.get(key)


def phase(name: str, key: str) -> Callable[[Result], Optional[float]]:
    return lambda r: r.phases.get(name, {}).get(key)


def columns(gpu: bool) -> List[tuple]:
    """(header, getter, show ratio to baseline) of each figure column; the device figures first."""
    device = [("GPU peak alloc (GiB)", overall("gpu_peak_allocated"), True),
              ("GPU train-loop peak", phase("train_loop", "gpu_peak_allocated"), True),
              ("GPU load peak", phase("load_transformer", "gpu_peak_allocated"), False)] if gpu else []
    host = "host peak RSS (GiB)" if gpu else "peak RSS (GiB; device = host)"
    return device + [(host, overall("host_peak_rss"), not gpu),
                     ("train-loop RSS", phase("train_loop", "host_peak_rss"), not gpu),
                     ("load RSS", phase("load_transformer", "host_peak_rss"), False),
                     ("s/step (wall)", lambda r: r.s_per_step, True),
                     ("CPU s/step", lambda r: r.cpu_s_per_step, True)]


def table(results: List[Result]) -> str:
    """A markdown table; ratios are to the first (baseline) row."""
    cols = columns(on_gpu(results))
    base = results[0]
    head = ["run", "profile", "weights", "ckpt", "swap", "opt"]
    for title, _, ratio in cols:
        head += [title] + (["x base"] if ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results, 1):
        c = r.config
        cells = [str(i), c.label, c.weights, "on" if c.checkpointing else "off", str(c.swap),
                 "adamw8bit" if c.adam8bit else "adamw"]
        for _, get, ratio in cols:
            value, ref = (get(r), get(base)) if r.ok else (None, None)
            cells.append("-" if value is None else f"{value:.2f}" if value < 100 else f"{value:.0f}")
            if ratio:
                cells.append(f"{value / ref:.2f}" if value is not None and ref else "-")
        if not r.ok:  # say why in the first figure cell: an OOM is a result too
            cells[6] = "OOM" if "out of memory" in r.error.lower() else "failed"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(results: List[Result]) -> Dict[str, str]:
    """Where the figures were taken (without importing torch here: the runs' logs name the device)."""
    from importlib.metadata import version

    return {"python": platform.python_version(), "torch": version("torch"),
            "devices": ", ".join(sorted({r.device for r in results if r.device})),
            "cpu": platform.processor() or platform.machine(), "cpu_count": str(os.cpu_count())}


def write_json(path: Path, settings: Dict, results: List[Result]) -> None:
    rows = [{**asdict(r), "config": {**asdict(r.config), "name": r.config.name}} for r in results]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "machine": machine(results), "rows": rows}, indent=2))


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 configurations instead of the full grid")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--model", type=Path, help="an existing diffusers Qwen-Image folder (default: build one)")
    p.add_argument("--img-size", type=int, default=64, help="training resolution, longest side (default 64)")
    p.add_argument("--steps", type=int, help="training steps per run (default 3, --quick 2)")
    p.add_argument("--swap", type=int, help="blocks_to_swap of the swap rows (default: half the blocks)")
    p.add_argument("--layers", type=int, default=6, help="blocks of the built benchmark transformer")
    p.add_argument("--stored-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the built transformer's file (bf16 as the real checkpoint; see docs)")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc's malloc settings alone")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable), e.g. quantize_text_encoder=true")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="pipeline, data, runs and logs")
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed per run")
    return p.parse_args(argv)


def run_all(configs: List[Config], args: argparse.Namespace, model: Path, data: Path, steps: int) -> List[Result]:
    """Run every configuration in turn, printing each command before it starts."""
    work, extra, results = args.work_dir.resolve(), extra_env(not args.no_malloc_tuning), []
    (work / "runs").mkdir(parents=True, exist_ok=True)
    for i, cfg in enumerate(configs, 1):
        cmd = command(cfg, model, data, work / "runs" / cfg.name, args.img_size, steps, args.overrides)
        print(f"[{i}/{len(configs)}] {cfg.label or cfg.name}\n  $ {shown(cmd, extra)}", flush=True)
        result = run(cfg, cmd, extra, work / "runs" / f"{cfg.name}.log", args.timeout)
        print(f"  -> {'ok' if result.ok else 'FAILED: ' + result.error} ({result.wall_s} s wall)", flush=True)
        results.append(result)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.model and not (args.model / "transformer" / "config.json").is_file():
        print(f"error: --model {args.model}: no diffusers Qwen-Image folder there (no transformer/config.json); "
              "give a local folder (hf download Qwen/Qwen-Image --local-dir DIR), or leave --model out to build "
              "a benchmark pipeline", file=sys.stderr)
        return 2
    work = args.work_dir.resolve()
    model = args.model.resolve() if args.model else \
        build_bench_pipeline(work / f"pipeline_{args.layers}x_{args.stored_dtype}", args.layers, args.stored_dtype)
    data = make_dataset(work / f"data_{args.img_size}", args.img_size)
    layers = transformer_config(model)["num_layers"]
    swap = args.swap if args.swap is not None else layers // 2
    steps = args.steps or (2 if args.quick else 3)
    configs = grid(args.quick, swap)
    print(f"model {model} ({layers} blocks), {args.img_size}px, {steps} steps, {len(configs)} runs", flush=True)
    results = run_all(configs, args, model, data, steps)
    print("\n" + table(results))
    settings = {"model": str(model), "blocks": layers, "img_size": args.img_size, "steps": steps, "swap": swap,
                "quick": args.quick, "base_config": BASE_CONFIG, "overrides": args.overrides,
                "env": extra_env(not args.no_malloc_tuning), "stored_dtype": None if args.model else args.stored_dtype}
    if args.out:
        write_json(args.out, settings, results)
        print(f"\nwrote {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
