"""The GPU report's measuring sections: machine, step time and MFU per family (with a torch.profiler
top-kernels table where a target family misses the H100 goal), the low-memory profiles' peak memory and
step time, attention backends, fp8 training, load time per loader and the start-up of a tiny train.py run.

They run inside the GPU pass (``benchmarks/gpu_pass.py``, stage ``report``: ``gpu_pass_measure.py report``),
one markdown record per section in its ``results.jsonl``; ``benchmarks/gpu_report.py`` is the command that asks
the pass for them and writes the report from those records (one program orchestrates measurements). The
models are full-size random-weight transformers built on the meta device and materialised on the GPU block by
block (``benchmarks/harness.py``); nothing is downloaded. A dry run runs every section on tiny CPU models.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.gpu_pass_stages import TARGET_S_PER_STEP  # noqa: E402
from trainer.families import SPECS  # noqa: E402
from utils import page_cache  # noqa: E402

TARGET_FAMILIES = ("qwen_image", "flux")  # the families issue 10's speed target names
SECTIONS = ("machine", "steps", "memory", "attention", "fp8", "loading", "startup")
DEFAULT_OUT_DIR = ROOT / "output" / "gpu_report"  # not docs/: docs/GPU_RESULTS.md is gpu_pass_docs.py's alone
FULL_QWEN_BYTES = 20.43e9 * 2  # the bf16 Qwen-Image transformer, for load-time extrapolation
FAMILY_NAMES = {name: spec.title for name, spec in SPECS.items()}


@dataclass
class Run:
    """What this invocation measures and how."""

    device: torch.device
    scale: harness.Scale
    resolution: int
    steps: int
    families: List[str]
    dry_run: bool
    load_layers: int
    peak_tflops: Optional[float]
    argv: List[str]

    def command(self, section: str) -> str:
        """The command that reproduces one section of this run (its flags, that section only)."""
        args, i = [], 0
        while i < len(self.argv):
            arg = self.argv[i]
            i += 1
            if arg == "--sections":
                while i < len(self.argv) and self.argv[i] in SECTIONS:
                    i += 1
            elif arg == "--out":
                i += 1
            elif not arg.startswith(("--out=", "--sections=")):
                args.append(arg)
        return shlex.join(["python", "benchmarks/gpu_report.py", *args, "--sections", section])

    def guard(self, what: str, exc: Exception) -> str:
        """A failed measurement becomes a line of the report on a GPU run (the others still run);
        a dry run re-raises, so the script's own bugs surface."""
        if self.dry_run:
            raise exc
        free_memory()
        return f"failed ({what}): {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def fmt(value: Optional[float], spec: str = ".2f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def section(title: str, run: Run, name: str, body: str) -> str:
    return f"## {title}\n\nCommand: `{run.command(name)}`\n\n{body.rstrip()}\n"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# =========================================================================== machine


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty.strip() else "")
    except OSError:
        return "unknown"


def machine_section(run: Run) -> str:
    facts = harness.machine_facts()
    peak = run.peak_tflops or harness.peak_bf16_tflops(facts["gpu"])
    rows = [("GPU", f"{facts['gpu']}" + (f" x{facts.get('gpus')}" if facts.get("gpus", 1) > 1 else "")),
            ("Compute capability", fmt(facts["capability"], "")), ("Memory (GiB)", fmt(facts["memory_gib"], "")),
            ("Driver", fmt(facts["driver"], "")), ("torch", facts["torch"]), ("CUDA (torch build)", fmt(facts["cuda"], "")),
            ("cuDNN", fmt(facts["cudnn"], "")), ("Dense bf16 peak used for MFU (TFLOP/s)", fmt(peak, ".1f")),
            ("Commit", git_commit())]
    return section("Machine", run, "machine", table(("", ""), rows))


# =========================================================================== step time and MFU


@dataclass
class StepRow:
    family: str
    checkpointing: bool
    compile: str  # the engine's setting: "auto" (its default) or "off"
    report: Optional[harness.StepReport]
    flops: Optional[harness.StepFlops]
    error: Optional[str] = None
    profile: Optional[harness.KernelProfile] = None
    compiled: bool = False
    first_step_s: Optional[float] = None  # includes the compilation when compiled


# (checkpointing, compile) per family: the engine's default, eager for comparison, no checkpointing.
STEP_VARIANTS = ((True, "auto"), (True, "off"), (False, "auto"))


def measure_steps(run: Run, family: str, checkpointing: bool, compile: str, profile_if_slow: bool) -> StepRow:
    """LoRA steps of one family; a torch.profiler pass when it misses the target (always in a dry run,
    to exercise the path)."""
    overrides = ["compile=false"] if compile == "off" else []
    try:
        with harness.rig_session(family, run.device, torch.bfloat16, scale=run.scale, overrides=overrides,
                                 checkpointing=checkpointing, resolution=run.resolution) as rig:
            report = harness.run_steps(rig, run.steps, run.resolution)
            row = StepRow(family, checkpointing, compile, report, harness.rig_flops(rig, report),
                          compiled=rig.compiled, first_step_s=report.step_times[0])
            slow = report.median_step_s > TARGET_S_PER_STEP or run.dry_run
            if profile_if_slow and slow:
                row.profile = harness.profile_top_kernels(rig, run.resolution)
            return row
    except torch.cuda.OutOfMemoryError:
        free_memory()
        return StepRow(family, checkpointing, compile, None, None, "out of memory")
    except Exception as exc:
        return StepRow(family, checkpointing, compile, None, None, run.guard("steps", exc))


def step_table(rows: List[StepRow], peak: Optional[float]) -> str:
    body = []
    for r in rows:
        name, ckpt = FAMILY_NAMES[r.family], "on" if r.checkpointing else "off"
        if r.report is None:
            body.append((name, ckpt, r.compile, r.error, "", "", "", "", "", "", ""))
            continue
        step = r.report.median_step_s
        target = f"{'meets' if step <= TARGET_S_PER_STEP else 'misses'} {TARGET_S_PER_STEP}" \
            if r.checkpointing and r.family in TARGET_FAMILIES and r.compile == "auto" else ""
        body.append((name, ckpt, f"{r.compile} ({'compiled' if r.compiled else 'eager'})", f"{step:.3f}",
                     fmt(r.first_step_s, ".1f"), f"{1 / step:.2f}", f"{r.flops.training / 1e12:.4g}",
                     f"{r.flops.training / step / 1e12:.4g}", fmt(harness.mfu(r.flops, step, peak), ".1%"),
                     fmt(r.report.peak_gib), target))
    return table(("Family", "Checkpointing", "Compile", "s/step", "First step s", "samples/s", "TFLOP/step",
                  "TFLOP/s", "MFU", "Peak GiB", "Target"), body)


FLOPS_NOTE = """\
FLOPs per step (model FLOPs, written out in `harness.step_flops`): every linear layer with N weights seeing
T tokens costs 2NT forward; backward costs 2NT for the input gradient and another 2NT for the weight
gradient only where the weight trains. With a frozen base and LoRA that is **4 x N x T** for the base
weights (not the 6 x N x T of full training) and 6 x N x T for the LoRA matrices; T is the image tokens
for image-stream layers, the text tokens for text-stream layers, both for FLUX single-stream blocks and 1
for modulation and embedders. Joint attention over S = image + text tokens adds 4 x S^2 x d forward and
twice that backward (**12 x S^2 x d** per block, d = heads x head_dim). Gradient checkpointing recomputes
the forward (another 2NT + 4S^2d) but MFU counts model FLOPs only, so a checkpointed run's MFU is the
same work done in more time. MFU = FLOPs per step / (s/step x dense bf16 peak).
"""


def steps_section(run: Run) -> str:
    rows = [measure_steps(run, family, ckpt, compile,
                          profile_if_slow=ckpt and compile == "auto" and family in TARGET_FAMILIES)
            for family in run.families for ckpt, compile in STEP_VARIANTS]
    peak = run.peak_tflops or harness.peak_bf16_tflops(harness.device_name(run.device))
    tokens = ", ".join(dict.fromkeys(f"{FAMILY_NAMES[r.family]} {r.report.image_tokens} image + "
                                     f"{r.report.text_tokens} text" for r in rows if r.report is not None))
    body = (f"LoRA (rank 16, the families' `attention` preset), AdamW, bf16 autocast, batch 1, "
            f"{run.resolution}^2 ({tokens} tokens); {run.steps} steps, s/step is the median after the warm-up "
            f"(the first two steps); *first step* includes the compilation when the blocks are compiled. "
            f"*Compile* `auto` is the engine's default (compiled on CUDA), `off` is `compile: false`.\n\n"
            f"{step_table(rows, peak)}\n\n{FLOPS_NOTE}")
    profiles = [r for r in rows if r.profile is not None]
    if profiles:
        body += "\n" + "\n".join(profile_block(r) for r in profiles)
    return section(f"Step time and MFU at {run.resolution}^2", run, "steps", body)


# --------------------------------------------------------------------------- profiles


def advice(prof: harness.KernelProfile) -> List[str]:
    """What would close the gap, from where the time goes."""
    shares, tips = prof.shares(), []
    if shares["attention"] >= 0.25:
        tips.append(f"Attention is {shares['attention']:.0%} of kernel time: FlashAttention-3 on Hopper "
                    "(`attention_backend: flash3`, needs `flash_attn_interface`) or the cuDNN kernel "
                    "(`cuda_features.enable_cudnn_sdp: true`); see the attention section for their times.")
    if shares["gemm"] >= 0.5:
        tips.append(f"GEMMs are {shares['gemm']:.0%}: the matmuls set the floor in bf16. fp8 training "
                    "(`cuda_features.enable_fp8_training`) raises their throughput on sm_89+; with "
                    "checkpointing on, about a third of them is the recomputed forward.")
    if shares["other"] >= 0.2:
        tips.append(f"Elementwise / norm / copy kernels are {shares['other']:.0%}: `torch.compile` of the "
                    "transformer blocks would fuse modulation, norms, RoPE and activations.")
    if shares["optimizer"] >= 0.03:
        tips.append(f"Optimizer kernels are {shares['optimizer']:.0%}: a fused AdamW (`fused=True`).")
    if prof.device == "cuda" and prof.busy_s < 0.9 * prof.wall_s:
        tips.append(f"The GPU is idle {1 - prof.busy_s / prof.wall_s:.0%} of the step (launch overhead, host "
                    "syncs): CUDA graphs (`torch.compile(mode='reduce-overhead')`) or fewer syncs per step.")
    return tips or ["No single category dominates; compare the top kernels with the attention section."]


def profile_block(row: StepRow) -> str:
    prof = row.profile
    unit = "device" if prof.device == "cuda" else "CPU"
    rows = [(f"`{r.name[:90]}`", r.calls, f"{r.self_ms:.1f}", f"{r.share:.1%}", harness.kernel_category(r.name))
            for r in prof.top(15)]
    shares = ", ".join(f"{k} {v:.0%}" for k, v in prof.shares().items())
    return (f"### Profile: {FAMILY_NAMES[row.family]}, checkpointing on, compile {row.compile} "
            f"({row.report.median_step_s:.3f} s/step, "
            f"target {TARGET_S_PER_STEP})\n\ntorch.profiler over {prof.steps} steps: {unit} busy "
            f"{prof.busy_s:.3f} s of {prof.wall_s:.3f} s wall per step; {shares}.\n\n"
            + table(("Kernel", "Calls", f"Self {unit} ms", "Share", "Category"), rows)
            + "\n\nWhat would close the gap:\n\n" + "\n".join(f"- {tip}" for tip in advice(prof)) + "\n")


# =========================================================================== memory profiles


# (profile, overrides, what the row shows): the two shipped profiles, then the other weight formats
# and block swap with quantized and with bf16 blocks, each on the 24 GB profile's YAML.
MEMORY_ROWS: Tuple[Tuple[str, Tuple[str, ...], str], ...] = (
    ("24gb", (), "as shipped"),
    ("16gb", (), "as shipped"),
    ("24gb", ("quantization.weights=qint8",), "quanto qint8"),
    ("24gb", ("quantization.weights=qint4",), "quanto qint4"),
    ("24gb", ("quantization.backend=torchao", "quantization.weights=int8_weight_only"), "torchao int8 weight-only"),
    # bf16 blocks do not fit 24 GiB (that is the row's point): auto_fit, which would refuse them, is off
    ("24gb", ("auto_fit=false", "quantize=false", "blocks_to_swap=30"), "bf16 blocks, 30 swapped"),
    ("24gb", ("auto_fit=false", "quantize=false"), "bf16 blocks, none swapped"),
    ("flux2_klein", (), "FLUX.2 [klein] base 4B profile, as shipped (bf16)"),
    ("krea2_24gb", (), "Krea 2 Raw 24 GB profile, as shipped (qfloat8 blocks)"),
    ("qwen21_24gb", (), "Qwen-Image-2.1 24 GB profile, as shipped (qfloat8 blocks)"),
)


MEMORY_STEPS = 5


def memory_section(run: Run) -> str:
    rows = []
    steps = min(MEMORY_STEPS, run.steps) if run.dry_run else MEMORY_STEPS  # the dry run checks code paths, not times
    for name, overrides, what in MEMORY_ROWS:
        if harness.PROFILE_FAMILIES.get(name, "qwen_image") not in run.families:
            continue  # --families narrows this section too (and --scale klein9b is FLUX.2's size)
        yaml, budget = harness.PROFILES[name]
        shipped = not overrides
        try:
            rep = harness.memory_profile(name, run.device, scale=run.scale, resolution=run.resolution, steps=steps,
                                         overrides=overrides)
        except Exception as exc:
            rows.append((name, what, run.guard("memory", exc), "", "", "", "", "", "", "", ""))
            free_memory()
            continue
        within = {None: "n/a", True: "yes", False: "**no**"}[rep.within_budget] if shipped else ""
        rows.append((name, what, rep.blocks_to_swap, fmt(rep.load_peak_gib), fmt(rep.train_peak_gib),
                     fmt(rep.device_peak_gib), f"{budget:.0f}" if shipped else "", within, fmt(rep.planned_gib),
                     fmt(rep.plan_error, "+.0%"), f"{rep.steps.median_step_s:.3f}"))
        free_memory()
    body = (f"Qwen-Image LoRA (FLUX.2 klein in its row) at {run.resolution}^2 with each profile's YAML as the "
            "engine builds it: blocks "
            "quantized one at a time by `place`, `blocks_to_swap` blocks in host memory with `BlockSwapper`, "
            f"8-bit AdamW, gradient checkpointing with the kept block inputs in host memory; {steps} steps. "
            "*Load peak* "
            "and *train peak* are `torch.cuda.max_memory_allocated`; *device peak* is `max_memory_reserved` plus "
            "the memory the process holds outside torch's allocator (CUDA context), the figure compared with the "
            "budget (together with the load peak) and with `utils.memory_planner` (goal: within +-15%). The rows "
            "after the two shipped profiles change one thing of the 24 GB YAML. Compare *s/step* with the bf16 "
            "rows of the step-time section (the profiles run eagerly: quanto blocks are not compiled).\n\n"
            + table(("Profile", "Variant", "Swapped blocks", "Load peak", "Train peak", "Device peak", "Budget",
                     "Within", "Planner", "Planner error", "s/step"), rows))
    return section("Low-memory profiles: peak memory (GiB) and step time", run, "memory", body)


# =========================================================================== attention, fp8


def one_per_transformer(families: Sequence[str]) -> List[str]:
    """The first of the families sharing each transformer class: they share its attention."""
    first: Dict[str, str] = {}
    for family in families:
        first.setdefault(SPECS[family].transformer, family)
    return list(first.values())


def attention_section(run: Run) -> str:
    parts = []
    for family in one_per_transformer(run.families):
        try:
            rep = harness.compare_attention_backends(family, run.device, torch.bfloat16, run.resolution,
                                                     scale=run.scale)
        except Exception as exc:
            parts.append(f"{FAMILY_NAMES[family]}: {run.guard('attention', exc)}")
            continue
        rows = [(r.name + (" (auto)" if r.name == rep.auto else ""), fmt(r.ms), fmt(r.out_error, ".1e"),
                 fmt(r.grad_error, ".1e"), "yes" if r.correct(rep.tolerance) else f"**no** {r.failure or ''}")
                for r in rep.results]
        verdict = "is" if rep.auto_is_fastest() else "is **not**"
        parts.append(f"{FAMILY_NAMES[family]}: q, k, v of shape {rep.shape} (B, heads, tokens, head_dim), "
                     f"{rep.dtype}. The engine's auto choice `{rep.auto}` {verdict} the fastest (within 10%); "
                     f"fastest: `{rep.fastest}`.\n\n"
                     + table(("Backend", "fwd+bwd ms", "out rel. error", "dQ rel. error",
                              f"within {rep.tolerance:g}"), rows))
        free_memory()
    intro = ("Every SDPA backend available here, forced one at a time (no fallback), against the math kernel "
             "in fp32 (relative L2 error of the output and of dQ).\n\n")
    return section("Attention backends", run, "attention", intro + "\n\n".join(parts))


def fp8_section(run: Run) -> str:
    try:
        rep = harness.fp8_smoke("qwen_image", steps=5, resolution=run.resolution, device=run.device, scale=run.scale)
    except Exception as exc:
        return section("fp8 training (Qwen-Image LoRA)", run, "fp8", run.guard("fp8", exc))
    if not rep.ran:
        body = f"Skipped: {rep.reason}."
    else:
        s, b = rep.steps, rep.bf16
        verdict = "faster" if rep.speedup > 1 else "**slower**"
        body = (f"{rep.reason}: {s.median_step_s:.3f} s/step against {b.median_step_s:.3f} s/step in bf16 "
                f"(compiled too): fp8 is {verdict}, x{rep.speedup:.2f}. Peak {fmt(s.peak_gib)} GiB against "
                f"{fmt(b.peak_gib)}; losses {', '.join(f'{x:.4f}' for x in s.losses)} "
                f"({'finite' if s.finite else '**NaN/inf**'}). Eager fp8 is refused by the engine.")
    return section("fp8 training (Qwen-Image LoRA)", run, "fp8", body)


# =========================================================================== loading


def write_checkpoint(run: Run, folder: Path) -> Tuple[type, int]:
    """A random Qwen-Image transformer with ``load_layers`` blocks (full width) saved in the diffusers
    layout; returns its class and size in bytes."""
    scale = harness.Scale(f"load{run.load_layers}", layers=run.load_layers) if not run.dry_run else run.scale
    model_dir = harness.model_folder("qwen_image", scale)
    from trainer.families.base import load_family

    fam = load_family(harness.train_config("qwen_image", model_dir))
    model = harness.build_meta_transformer(model_dir)
    harness.materialise(model, fam.blocks(model), run.device, torch.bfloat16, keep_on="cpu")
    model.save_pretrained(str(folder / "transformer"), safe_serialization=True, max_shard_size="2GB")
    cls = type(model)
    del model
    free_memory()
    size = sum(f.stat().st_size for f in (folder / "transformer").glob("*.safetensors"))
    return cls, size


def loaders(cls: type, folder: Path, device: torch.device) -> Dict[str, Callable[[], object]]:
    """Each way the project can load a transformer, onto ``device``."""
    out: Dict[str, Callable[[], object]] = {
        "diffusers from_pretrained": lambda: cls.from_pretrained(str(folder), subfolder="transformer",
                                                                 torch_dtype=torch.bfloat16).to(device)}
    try:
        from utils import fast_loading
    except ImportError:
        return out
    files = fast_loading.weight_files(folder / "transformer")
    for loader in ("safetensors", "fastsafetensors", "auto"):
        out[f"fast_loading.load_state_dict ({loader})"] = \
            lambda loader=loader: fast_loading.load_state_dict(files, device=device, loader=loader)
    out["fast_loading.load_model_streamed (auto)"] = lambda: fast_loading.load_model_streamed(
        cls, folder, "transformer", dtype=torch.bfloat16, device=device)
    return out


def time_load(load: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    result = load()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del result
    free_memory()
    return seconds


def loading_section(run: Run) -> str:
    with tempfile.TemporaryDirectory(prefix="gpu-report-ckpt-") as tmp:
        folder = Path(tmp)
        cls, size = write_checkpoint(run, folder)
        rows = []
        for name, load in loaders(cls, folder, run.device).items():
            try:
                for path in folder.rglob("*.safetensors"):
                    page_cache.evict(path)
                cold = time_load(load, run.device)
                warm = time_load(load, run.device)
            except Exception as exc:  # a reader that fails is a row, not a failed report
                rows.append((name, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", "", "", ""))
                free_memory()
                continue
            rows.append((name, f"{cold:.2f}", f"{size / cold / 1e9:.2f}", f"{warm:.2f}",
                         f"{FULL_QWEN_BYTES / (size / cold):.1f}"))
    shape = "the tiny dry-run scale" if run.dry_run else f"{run.load_layers} of its 60 blocks at full width"
    body = (f"A random-weight Qwen-Image transformer with {shape} ({size / 1e9:.3g} GB of bf16 safetensors "
            f"in 2 GB shards) loaded onto "
            f"`{run.device}`. *Cold*: after evicting the files from the page cache (`posix_fadvise`, best "
            "effort); *warm*: read again at once. The last column scales the cold rate to the full 40.9 GB "
            "transformer.\n\n" + table(("Loader", "Cold s", "Cold GB/s", "Warm s", "Full Qwen-Image est. s"), rows))
    return section("Load time per loader", run, "loading", body)


# =========================================================================== start-up


STARTUP_STEPS = 12  # checkpoints at half and at the end
DRY_RUN_STARTUP_STEPS = 4  # the dry run checks the section's code (both checkpoints included), not its times


def tiny_train_run(prefix: Sequence[str], tmp: Path, model: Path, data: Path, precision: str,
                   steps: int = STARTUP_STEPS) -> Tuple[float, dict]:
    """One tiny run of ``train.py`` (``steps`` steps) started as a user starts it (``prefix``: the interpreter
    or a launcher): its wall time and ``summary.json``. Raises RuntimeError with the last line of stderr."""
    out = tmp / "out"
    cmd = list(prefix) + [str(ROOT / "train.py"), "--config", str(ROOT / "train_configs/quickstart_tiny.yaml"),
                          f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
                          f"output_dir={out}", "overwrite_output_dir=true", f"cache_dir={tmp / 'cache'}",
                          f"max_train_steps={steps}", f"checkpointing_steps={steps // 2}", "report_to=none",
                          f"mixed_precision={precision}"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1][:100] if done.stderr.strip() else f"exit {done.returncode}")
    return wall, json.loads((out / "summary.json").read_text())


STARTUP_PHASES = ("imports", "setup", "prepare_data", "setup_model", "train")


def startup_section(run: Run) -> str:
    """Wall time of a tiny run of ``train.py`` (the embedded tiny Qwen-Image, sample data) as a user
    starts it, with where the seconds go (the engine's own phase timings from summary.json)."""
    from image_datasets.sample_data import make_sample_dataset
    from utils.tiny_models import build_tiny_pipeline

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-report-startup-") as tmp:
        model = build_tiny_pipeline("qwen_image", Path(tmp) / "model", seed=0)
        data = make_sample_dataset(Path(tmp) / "data", size=64, count=6)
        precision = "no" if run.device.type == "cpu" else "bf16"
        launchers = {"python": [sys.executable],
                     "accelerate launch": [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                                           "--num_machines", "1", "--mixed_precision", precision,
                                           "--dynamo_backend", "no", *(["--cpu"] if run.device.type == "cpu" else [])]}
        steps = DRY_RUN_STARTUP_STEPS if run.dry_run else STARTUP_STEPS
        if run.dry_run:  # the script's own check: one launcher is enough
            launchers.pop("accelerate launch")
        for launcher, prefix in launchers.items():
            for cache in ("first run", "cache on disk"):
                try:
                    wall, summary = tiny_train_run(prefix, Path(tmp), model, data, precision, steps)
                except RuntimeError as exc:
                    rows.append((launcher, cache, f"failed: {exc}") + ("",) * 7)
                    continue
                phases = summary.get("wall_seconds", {})
                rows.append((launcher, cache, f"{wall:.1f}", *(fmt(phases.get(k), ".1f") for k in STARTUP_PHASES),
                             fmt(summary.get("first_step_s"), ".2f")))
            if (Path(tmp) / "cache").exists():
                shutil.rmtree(Path(tmp) / "cache")
    body = (f"`train.py` on the embedded tiny Qwen-Image (`utils/tiny_models`) with 6 sample images, "
            f"{steps} steps, checkpoints at {steps // 2} and {steps}, on `{run.device.type}`. "
            "*Wall* is measured outside "
            "the process; the phases are the engine's own (`summary.json`: *imports* is the interpreter start "
            "until the engine runs, *prepare_data* includes the cache pass: text encoder and VAE, *train* "
            "includes the checkpoints). The rest of the wall time is the launcher, saving the final file and "
            "the interpreter's exit.\n\n"
            + table(("Launcher", "Cache", "Wall s", "Imports s", "Set-up s", "Data + cache pass s", "Model s",
                     "Train s", "First step s"), rows))
    return section("Start-up of a tiny run", run, "startup", body)


# =========================================================================== main


BUILDERS = {"machine": machine_section, "steps": steps_section, "memory": memory_section,
            "attention": attention_section, "fp8": fp8_section, "loading": loading_section,
            "startup": startup_section}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, written to a temp file")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"markdown file (default {DEFAULT_OUT_DIR.relative_to(ROOT)}/GPU_REPORT-<time>.md)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--families", nargs="+", choices=harness.FAMILIES, default=list(harness.FAMILIES))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; dry run 3)")
    parser.add_argument("--resolution", type=int, default=None, help="image side (default 1024; dry run 64)")
    parser.add_argument("--load-layers", type=int, default=12,
                        help="blocks of the checkpoint written for the load timing (full width)")
    parser.add_argument("--scale", choices=[name for name in harness.SCALES if name != "tiny"], default="full",
                        help="model size: full (each family's published size) or klein9b (FLUX.2 [klein] 9B, "
                             "--families flux2 only)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak for MFU when the GPU is not in harness.PEAK_BF16_TFLOPS")
    return parser.parse_args(argv)


def run_scale(args: argparse.Namespace) -> harness.Scale:
    """The model size ``--scale`` names; klein9b is FLUX.2's own size, meaningless for another family."""
    if args.scale == "klein9b" and list(args.families) != ["flux2"]:
        raise SystemExit("--scale klein9b builds FLUX.2 [klein] 9B: use it with --families flux2 only")
    return harness.SCALES[args.scale]


def make_run(args: argparse.Namespace, argv: List[str]) -> Run:
    """What one report measures, from its command line (``argv``: the sections name their commands with it)."""
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(f"{harness.no_cuda_reason()}\nUse --dry-run to exercise the script on the CPU.")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    return Run(device, harness.TINY if args.dry_run else run_scale(args),
               args.resolution or (64 if args.dry_run else 1024), args.steps or (3 if args.dry_run else 10),
               list(args.families), args.dry_run, args.load_layers, args.peak_tflops, argv)


def quiet_logs() -> None:
    """The engine logs every model build at INFO; the report keeps warnings only."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")

