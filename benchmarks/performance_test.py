"""Loading and training benchmark: load time and peak host memory per loader, training throughput with
caching on and off, peak memory per phase. One run prints a table of ratios and writes JSON and a PNG.

    OMP_NUM_THREADS=1 python benchmarks/performance_test.py            # ~2 GB Qwen-Image checkpoint
    OMP_NUM_THREADS=1 python benchmarks/performance_test.py --quick    # ~0.35 GB, < 2 min on 2 idle cores

Loads (each measurement in a fresh subprocess, so peak RSS and imports do not carry over):
``diffusers`` (``from_pretrained``), ``safetensors`` / ``fastsafetensors`` / ``auto``
(``utils.fast_loading.load_state_dict``), ``streamed`` / ``streamed_fst`` (``load_model_streamed`` with
the auto and the fastsafetensors reader). Cold runs drop the files from the page cache first
(``posix_fadvise(DONTNEED)``, checked with ``mincore``); warm runs read them into it first. ``load`` is
the time until the call returns; ``ready`` adds touching every 4 KiB page of every CPU tensor, since
memory-mapped loads return before reading anything. On a CUDA machine the loads target the GPU and the
peak GPU memory is reported as well.

Training: ``train.py`` on the tiny Qwen-Image model (built offline) with the embedding caches on and
off; step time and samples/s come from its "trained N steps in X s" line, peaks per phase from its
"Memory phase" lines (``utils.memory_monitor.MemoryMonitor``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from utils import page_cache  # noqa: E402

GIB = 2**30
STATE_DICT_METHODS = ("safetensors", "fastsafetensors", "auto")
MODEL_METHODS = ("diffusers", "streamed", "streamed_fst")
METHODS = ("diffusers", *STATE_DICT_METHODS, "streamed", "streamed_fst")
RESULT_TAG = "BENCHMARK_RESULT "


# =========================================================================== page cache


# =========================================================================== worker (one load)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _touch(tensors: Sequence[Any]) -> int:
    """Read one byte of every 4 KiB page of every CPU tensor (faults memory-mapped pages in)."""
    import torch

    total = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        total += int(tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def _load(method: str, folder: Path, device: str, dtype: Any, threads: int) -> Any:
    from utils.fast_loading import load_model_streamed, load_state_dict, weight_files

    if method in STATE_DICT_METHODS:
        return load_state_dict(weight_files(folder), device=device, loader=method, num_threads=threads)
    model_class = _model_class(folder)
    if method == "diffusers":
        model = model_class.from_pretrained(str(folder.parent), subfolder=folder.name, dtype=dtype)
        return model.to(device)
    loader = "fastsafetensors" if method == "streamed_fst" else "auto"
    return load_model_streamed(model_class, folder.parent, folder.name, dtype=dtype, device=device,
                               loader=loader, num_threads=threads)


def _model_class(folder: Path) -> type:
    import diffusers

    name = json.loads((folder / "config.json").read_text())["_class_name"]
    return getattr(diffusers, name)


def worker(method: str, folder: Path, device: str, dtype_name: str, threads: int) -> Dict[str, Any]:
    """Load once in this fresh process and report times and memory (GiB)."""
    import torch

    from utils.memory_monitor import MemoryMonitor, get_memory_stats

    import safetensors.torch  # noqa: F401  (imports out of the timed region)
    if method in MODEL_METHODS:
        _model_class(folder)
    if "fst" in method or "fastsafetensors" in method or device.startswith("cuda"):
        try:
            import fastsafetensors  # noqa: F401
        except ImportError:
            pass
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    cuda = device.startswith("cuda")
    if cuda:
        torch.zeros(1, device=device)  # CUDA context outside the timed region
    monitor = MemoryMonitor()
    base = get_memory_stats()["host_rss_gib"]
    start, cpu_start = time.perf_counter(), time.process_time()
    with monitor.phase("load"):
        loaded = _load(method, folder, device, dtype, threads)
        if cuda:
            torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    tensors = list(loaded.values()) if isinstance(loaded, dict) else list(loaded.state_dict().values())
    with monitor.phase("touch"):
        _touch(tensors)
    ready_s = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start  # all threads; less sensitive to other processes than wall time
    phases = monitor.summary()["phases"]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    peak = max(phases["load"]["host_peak_rss_gib"], phases["touch"]["host_peak_rss_gib"])
    result = {
        "method": method, "device": device, "load_s": load_s, "ready_s": ready_s, "cpu_s": cpu_s,
        "host_rss_base_gib": base, "host_peak_growth_gib": round(peak - base, 3),
        "host_load_peak_growth_gib": round(phases["load"]["host_peak_rss_gib"] - base, 3),
        "host_rss_after_gib": get_memory_stats()["host_rss_gib"], "weights_gib": round(weights / GIB, 3),
        "tensors": len(tensors), "phases": phases,
    }
    if cuda:
        result["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return result


# =========================================================================== orchestration


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_worker(method: str, folder: Path, device: str, dtype: str, threads: int) -> Dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--checkpoint", str(folder),
           "--device", device, "--dtype", dtype, "--num-threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"worker {method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def measure_loads(folder: Path, methods: Sequence[str], device: str, dtype: str, threads: int,
                  repeats: int) -> List[Dict[str, Any]]:
    """Cold (page cache dropped) and warm runs of every method; medians over ``repeats`` runs each.

    Methods take turns within each round, so a change in the machine's background load during the
    benchmark falls on all of them alike instead of on whichever ran last.
    """
    from utils.fast_loading import weight_files

    files = weight_files(folder)
    rows = []
    for state in ("cold", "warm"):
        runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(repeats):
            for method in methods:
                runs[method].append(_one_load(method, state, files, folder, device, dtype, threads))
        for method in methods:
            rows.append(_median_run(method, state, runs[method]))
            print(f"  {method:16s} {state}: ready {rows[-1]['ready_s']:.2f} s (runs {rows[-1]['ready_s_all']}), "
                  f"peak RSS +{rows[-1]['host_peak_growth_gib']:.2f} GiB", flush=True)
    return rows


def _one_load(method: str, state: str, files: List[Path], folder: Path, device: str, dtype: str,
              threads: int) -> Dict[str, Any]:
    for path in files:
        (page_cache.evict if state == "cold" else page_cache.read_in)(path)
    resident = [page_cache.cached_fraction([p]) for p in files]
    run = run_worker(method, folder, device, dtype, threads)
    run["resident_before"] = None if None in resident else round(statistics.mean(resident), 3)
    return run


def _median_run(method: str, state: str, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    row = dict(runs[0])
    for key in ("load_s", "ready_s", "cpu_s", "host_peak_growth_gib", "host_load_peak_growth_gib",
                "gpu_peak_allocated_gib"):
        if key in row:
            row[key] = statistics.median(r[key] for r in runs)
    row.update(state=state, runs=len(runs), ready_s_all=[round(r["ready_s"], 3) for r in runs])
    return row


# --------------------------------------------------------------------------- training


def _train_run(model: Path, data: Path, out: Path, steps: int, caching: bool) -> Dict[str, Any]:
    flag = str(caching).lower()
    cmd = [sys.executable, "train.py", "--config", "train_configs/quickstart_tiny.yaml",
           f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
           f"max_train_steps={steps}", "report_to=none", f"checkpointing_steps={steps + 1000}",
           "save_cache_on_disk=false", "overwrite_output_dir=true", "seed=0",
           f"precompute_text_embeddings={flag}", f"precompute_image_embeddings={flag}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    trained = re.search(r"trained (\d+) steps in ([\d.]+) s", log)
    if proc.returncode != 0 or trained is None:
        raise RuntimeError(f"train.py (caching={caching}) failed:\n{log[-3000:]}")
    done, seconds = int(trained.group(1)), float(trained.group(2))
    # train.py rounds to 0.1 s: take the loop time from the train_loop phase where it is finer.
    phases = _phases(log)
    loop_s = phases.get("train_loop", {}).get("seconds", seconds)
    batch = 1  # quickstart_tiny.yaml: data_config.train_batch_size
    return {"caching": caching, "steps": done, "loop_s": loop_s, "step_s": loop_s / done,
            "samples_per_s": done * batch / loop_s, "wall_s": wall, "phases": phases}


def _phases(log: str) -> Dict[str, Dict[str, float]]:
    """``Memory phase 'name' (1.2s): host_peak_rss=0.45GiB, ...`` lines -> {name: {seconds, figures}}."""
    found: Dict[str, Dict[str, float]] = {}
    for name, seconds, figures in re.findall(r"Memory phase '(\w+)' \(([\d.]+)s\): ([^\n]*)", log):
        entry = {"seconds": float(seconds)}
        for key, value in re.findall(r"(\w+)=([\d.]+)GiB", figures):
            entry[f"{key}_gib"] = float(value)
        found[name] = entry
    return found


def measure_training(work: Path, steps: int) -> List[Dict[str, Any]]:
    from image_datasets.sample_data import make_sample_dataset
    from utils.tiny_models import build_tiny_pipeline

    model = work / "tiny-qwen-image"
    if not (model / "model_index.json").is_file():
        build_tiny_pipeline("qwen_image", model, seed=0)
    data = make_sample_dataset(work / "sample-data", size=64, count=6)
    runs = []
    for caching in (True, False):
        runs.append(_train_run(model, data, work / f"train-caching-{str(caching).lower()}", steps, caching))
        r = runs[-1]
        print(f"  caching {'on ' if caching else 'off'}: {r['steps']} steps, {r['step_s'] * 1000:.1f} ms/step, "
              f"{r['samples_per_s']:.1f} samples/s", flush=True)
    return runs


# --------------------------------------------------------------------------- checkpoint


def ensure_checkpoint(args: argparse.Namespace) -> Dict[str, Any]:
    """The synthetic checkpoint to measure (reused when one with the same settings exists)."""
    from benchmarks.make_synthetic_checkpoint import make_synthetic_checkpoint

    if args.checkpoint is not None:
        root = args.checkpoint if (args.checkpoint / "transformer").is_dir() else args.checkpoint.parent
        info_file = root / "synthetic_checkpoint.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else {"subfolder": args.checkpoint.name}
        return {**info, "root": str(root)}
    name = f"synthetic-{args.family}-{args.num_layers}L-{args.num_heads or 24}H-{args.dtype}-{args.max_shard_size}"
    root = args.work_dir / name
    info_file = root / "synthetic_checkpoint.json"
    if not info_file.is_file():
        print(f"writing synthetic checkpoint {root} ...", flush=True)
        make_synthetic_checkpoint(root, args.family, args.num_layers, None, args.num_heads, args.dtype,
                                  args.max_shard_size)
    return {**json.loads(info_file.read_text()), "root": str(root)}


# =========================================================================== report


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return "-" if not value or not base else f"{value / base:.2f}x"


def load_table(rows: List[Dict[str, Any]]) -> str:
    """Methods side by side: seconds and ratios to diffusers' from_pretrained, cold and warm."""
    by = {(r["method"], r["state"]): r for r in rows}
    base = {s: by.get(("diffusers", s)) for s in ("cold", "warm")}
    head = (f"{'method':15s} | {'cold load':>9s} {'ready':>7s} {'vs diff':>7s} | {'warm load':>9s} {'ready':>7s} "
            f"{'vs diff':>7s} | {'peak RSS +GiB':>13s} {'vs diff':>7s} | {'load peak':>9s}")
    lines = [head, "-" * len(head)]
    for method in dict.fromkeys(r["method"] for r in rows):
        cold, warm = by.get((method, "cold")), by.get((method, "warm"))
        cells = []
        for run, ref in ((cold, base["cold"]), (warm, base["warm"])):
            ratio = _ratio(run["ready_s"], ref and ref["ready_s"]) if run else "-"
            cells.append(f"{run['load_s']:9.2f} {run['ready_s']:7.2f} {ratio:>7s}" if run
                         else f"{'-':>9s} {'-':>7s} {'-':>7s}")
        mem = warm or cold
        ref = base["warm"] or base["cold"]
        lines.append(f"{method:15s} | {cells[0]} | {cells[1]} | {mem['host_peak_growth_gib']:13.2f} "
                     f"{_ratio(mem['host_peak_growth_gib'], ref and ref['host_peak_growth_gib']):>7s} | "
                     f"{mem['host_load_peak_growth_gib']:9.2f}")
    return "\n".join(lines)


def goals(rows: List[Dict[str, Any]], info: Dict[str, Any]) -> Dict[str, Any]:
    """The issue's CPU goals, computed from the rows (GPU goals need a GPU run)."""
    by = {(r["method"], r["state"]): r for r in rows}
    out: Dict[str, Any] = {}
    for state in ("cold", "warm"):
        # Wall time, and CPU time (all threads), which other processes on a shared machine disturb less.
        for key, suffix in (("ready_s", ""), ("cpu_s", "_cpu")):
            singles = [by[(m, state)][key] for m in ("safetensors", "fastsafetensors") if (m, state) in by]
            if ("auto", state) in by and singles and min(singles) > 0:
                out[f"auto_vs_best_single_{state}{suffix}"] = round(by[("auto", state)][key] / min(singles), 3)
    shard_gib = info.get("largest_shard_bytes", 0) / GIB
    streamed = by.get(("streamed", "warm"))
    if streamed and shard_gib:
        # On the CPU the weights themselves stay in host memory: the overhead is what exceeds them.
        overhead = streamed["host_peak_growth_gib"] - streamed["weights_gib"]
        out["streamed_host_overhead_gib"] = round(overhead, 3)
        out["streamed_overhead_vs_largest_shard"] = round(overhead / shard_gib, 3)
        out["streamed_load_peak_vs_largest_shard"] = round(streamed["host_load_peak_growth_gib"] / shard_gib, 3)
    return out


def training_table(runs: List[Dict[str, Any]]) -> str:
    on = next((r for r in runs if r["caching"]), None)
    lines = [f"{'caching':8s} | {'steps':>5s} | {'ms/step':>8s} | {'samples/s':>9s} | {'vs on':>6s} | "
             f"{'run wall s':>10s} | peak host RSS per phase (GiB)"]
    lines.append("-" * len(lines[0]) + "-" * 20)
    for r in runs:
        phases = ", ".join(f"{k} {v.get('host_peak_rss_gib', 0):.2f}" for k, v in r["phases"].items())
        lines.append(f"{'on' if r['caching'] else 'off':8s} | {r['steps']:5d} | {r['step_s'] * 1000:8.1f} | "
                     f"{r['samples_per_s']:9.1f} | {_ratio(r['samples_per_s'], on and on['samples_per_s']):>6s} | "
                     f"{r['wall_s']:10.1f} | {phases}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- chart (PIL: no matplotlib)


def _bars(draw: Any, box: tuple, title: str, labels: List[str], series: Dict[str, List[float]],
          colors: List[str], unit: str) -> None:
    x0, y0, x1, y1 = box
    draw.text((x0, y0), title, fill="black")
    top, bottom, left = y0 + 34, y1 - 30, x0 + 10
    peak = max([v for vals in series.values() for v in vals] + [1e-9])
    group_w = (x1 - left) / max(1, len(labels))
    bar_w = group_w * 0.8 / max(1, len(series))
    draw.line((left, bottom, x1, bottom), fill="black")
    for gi, label in enumerate(labels):
        gx = left + gi * group_w + group_w * 0.1
        for si, (name, vals) in enumerate(series.items()):
            value = vals[gi]
            h = (bottom - top) * value / peak
            bx = gx + si * bar_w
            draw.rectangle((bx, bottom - h, bx + bar_w - 2, bottom), fill=colors[si % len(colors)])
            draw.text((bx, bottom - h - 12), f"{value:.2f}", fill="black")
        draw.text((gx, bottom + 6), label, fill="black")
    for si, name in enumerate(series):  # legend
        lx = x1 - 130
        ly = y0 + 2 + 14 * si
        draw.rectangle((lx, ly, lx + 10, ly + 10), fill=colors[si % len(colors)])
        draw.text((lx + 14, ly - 1), f"{name} ({unit})", fill="black")


def write_chart(path: Path, rows: List[Dict[str, Any]], training: List[Dict[str, Any]]) -> None:
    from PIL import Image, ImageDraw

    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["state"]): r for r in rows}
    image = Image.new("RGB", (1100, 300 * (3 if training else 2)), "white")
    draw = ImageDraw.Draw(image)
    colors = ["#4C72B0", "#DD8452", "#55A868"]
    _bars(draw, (20, 10, 1080, 290), "Load until every page is in memory (s), lower is better", methods,
          {s: [by.get((m, s), {}).get("ready_s", 0.0) for m in methods] for s in ("cold", "warm")}, colors, "s")
    warm = [by.get((m, "warm"), {}) for m in methods]
    _bars(draw, (20, 310, 1080, 590), "Peak host RSS growth, warm (GiB), lower is better", methods,
          {"load call": [r.get("host_load_peak_growth_gib", 0.0) for r in warm],
           "until ready": [r.get("host_peak_growth_gib", 0.0) for r in warm]}, colors[1:], "GiB")
    if training:
        _bars(draw, (20, 610, 600, 890), "Tiny Qwen-Image training (samples/s), higher is better",
              ["caching on" if r["caching"] else "caching off" for r in training],
              {"samples/s": [r["samples_per_s"] for r in training]}, colors, "1/s")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


# =========================================================================== main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Loading and training benchmark (see the module docstring).")
    p.add_argument("--quick", action="store_true",
                   help="~0.35 GB checkpoint, one cold and one warm run per method, 20 training steps")
    p.add_argument("--checkpoint", type=Path,
                   help="an existing model root (with transformer/) or transformer folder")
    p.add_argument("--family", choices=["qwen_image", "flux"], default="qwen_image")
    p.add_argument("--num-layers", type=int, default=None, help="default 3 (about 2 GB in bf16); quick: 2")
    p.add_argument("--num-heads", type=int, default=None, help="default 24 (the real width); quick: 12")
    p.add_argument("--max-shard-size", default=None, help="default 1GB; quick: 100MB")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(METHODS)}; default all "
                        "(quick: all but streamed_fst)")
    p.add_argument("--repeats", type=int, default=None,
                   help="cold and warm runs per method (median); default 3, quick 1")
    p.add_argument("--num-threads", type=int, default=8, help="fastsafetensors copy threads")
    p.add_argument("--train-steps", type=int, default=None, help="default 200; quick 20; 0 skips training")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/trainer-benchmark"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "performance.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.num_layers = args.num_layers if args.num_layers is not None else (2 if quick else 3)
    args.num_heads = args.num_heads if args.num_heads is not None else (12 if quick else None)
    args.max_shard_size = args.max_shard_size or ("100MB" if quick else "1GB")
    args.repeats = args.repeats or (1 if quick else 3)
    args.train_steps = args.train_steps if args.train_steps is not None else (20 if quick else 200)
    args.methods = args.methods or ",".join(m for m in METHODS if not (quick and m == "streamed_fst"))
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.checkpoint, args.device or "cpu", args.dtype, args.num_threads)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return result
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()  # other processes on the machine skew timings: recorded with them
    info = ensure_checkpoint(args)
    folder = Path(info["root"]) / info.get("subfolder", "transformer")
    print(f"checkpoint {folder}: {info.get('total_bytes', 0) / GIB:.2f} GiB, largest shard "
          f"{info.get('largest_shard_bytes', 0) / GIB:.2f} GiB; device {device}", flush=True)
    methods = [m for m in args.methods.split(",") if m]
    rows = measure_loads(folder, methods, device, args.dtype, args.num_threads, args.repeats)
    training = measure_training(args.work_dir, args.train_steps) if args.train_steps > 0 else []
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device,
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "checkpoint": info, "loads": rows, "goals": goals(rows, info), "training": training,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    write_chart(args.out.with_suffix(".png"), rows, training)
    print("\nLoad (seconds; ratios = time / diffusers from_pretrained; 'ready' = every page in memory)")
    print(load_table(rows))
    print("\nGoals:", json.dumps(report["goals"]))
    if training:
        print("\nTraining, tiny Qwen-Image (ratios = samples/s / caching on)")
        print(training_table(training))
    print(f"\nload average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"(cores: {os.cpu_count()})")
    print(f"{report['seconds']:.0f} s; results in {args.out} and {args.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
