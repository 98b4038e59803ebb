"""One measurement of the GPU pass (``benchmarks/gpu_pass.py``), run in its own process:

    python benchmarks/gpu_pass_measure.py qwen_step --out DIR [--dry-run]

Each result is appended to ``DIR/results.jsonl`` the moment it exists and echoed as a ``RESULT`` line,
so a stage stopped at its time limit keeps what it measured. On a GPU the models are full-size
random-weight transformers (``benchmarks/harness.py``: nothing downloaded) at 1024^2; ``--dry-run``
runs the same code on tiny models at 64^2 on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_pass_stages import MACHINE, RESULTS, TARGET_S_PER_STEP, append_record  # noqa: E402

# The project (engine, harness, diffusers) is imported only by the measurements that need it, so the
# machine record and quanto's build still happen where an import of the project fails.
harness: Any = None
sections: Any = None  # benchmarks/report_sections.py: gpu_report.py's sections, measured here
LIGHT = ("machine", "quanto_build")


def load_project() -> None:
    global harness, sections
    from benchmarks import harness as harness_module
    from benchmarks import report_sections as sections_module

    harness, sections = harness_module, sections_module


TARGET_S = TARGET_S_PER_STEP  # s/step, stated for an H100
FLUX2_GOAL_GIB, FLUX2_GOAL_MFU = 10.0, 0.30  # FLUX.2 [klein] 4B LoRA at 1024^2
PACKAGES = ("torch", "triton", "diffusers", "transformers", "accelerate", "peft", "safetensors", "optimum-quanto",
            "bitsandbytes", "torchao", "fastsafetensors", "omegaconf", "loguru", "huggingface-hub", "tokenizers",
            "numpy", "pytest", "pytest-xdist", "pytest-timeout")


@dataclass
class Ctx:
    """Where and at what size this process measures, and where it writes."""

    name: str
    out: Path
    dry_run: bool
    device: torch.device
    scale: harness.Scale
    resolution: int
    steps: int
    t0: float
    report_args: str = ""  # the report stage's gpu_report.py options

    def emit(self, kind: str, **fields: Any) -> None:
        append_record(self.out / RESULTS, {"kind": kind, "stage": self.name, "t": round(time.time() - self.t0, 1),
                                           **fields})
        short = ", ".join(f"{k}={_short(v)}" for k, v in fields.items() if not isinstance(v, (list, dict)))
        print(f"RESULT {kind}: {short}"[:400], flush=True)

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def report_run(self, section: str, families: List[str]) -> sections.Run:
        """A report ``Run`` for one of its sections at this process's size."""
        argv = ["--sections", section, "--families", *families] + (["--dry-run"] if self.dry_run else [])
        return sections.Run(self.device, self.scale, self.resolution, self.steps, families, self.dry_run,
                              12, None, argv)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("\n", " | ")


def context(name: str, out: Path, dry_run: bool) -> Ctx:
    """Where this process measures: the CPU at tiny scale in a dry run, else the GPU at full size."""
    t0 = float(os.environ.get("GPU_PASS_T0") or time.time())
    if name not in LIGHT:
        load_project()
    if dry_run:
        return Ctx(name, out, True, torch.device("cpu"), harness and harness.TINY, 64, 3, t0)
    if not torch.cuda.is_available() and name not in LIGHT:
        raise SystemExit(f"{harness.no_cuda_reason()}; use --dry-run on the CPU")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Ctx(name, out, False, device, harness and harness.FULL, 1024, 8, t0)


# =========================================================================== machine and build


def _run(cmd: List[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({' '.join(cmd)}: {exc})"


def versions() -> Dict[str, Optional[str]]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine(ctx: Ctx) -> None:
    """The GPU, driver, torch / CUDA / cuDNN, package versions, CPU and memory, and whether the project
    imports here (torch only otherwise); nvidia-smi and the full pip list go to machine.txt."""
    facts: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                             "gpu": "none (CPU)"}
    query = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                  "clocks.mem,power.limit,pstate,temperature.gpu", "--format=csv"])
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines = query.splitlines()
        facts.update(gpu=props.name, gpus=torch.cuda.device_count(), memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"sm_{props.major}{props.minor}", multiprocessors=props.multi_processor_count,
                     driver=lines[1].split(",")[1].strip() if len(lines) > 1 and "," in lines[1] else None,
                     flash_sdp=torch.backends.cuda.flash_sdp_enabled(), cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled())
    try:
        load_project()
        facts["peak_bf16_tflops"] = harness.peak_bf16_tflops(facts["gpu"])
        project = "ok"
    except Exception as exc:  # recorded: every other stage needs these imports
        traceback.print_exc()
        project = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    smi = _run(["nvidia-smi"])
    pip = _run([sys.executable, "-m", "pip", "list", "--format=freeze"])
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    (ctx.out / MACHINE).write_text(f"$ nvidia-smi\n{smi}\n\n$ nvidia-smi --query-gpu=...\n{query}\n\n"
                                   f"$ uname -a\n{platform.uname()}\n\n$ python -m pip list\n{pip}\n")
    ctx.emit("machine", **facts, project_imports=project, versions=versions(), python=sys.version.split()[0],
             cpus=os.cpu_count(), host_memory_gib=round(mem_gib, 1), kernel=platform.release(),
             nvidia_smi=query, pythonpath=os.environ.get("PYTHONPATH", ""))
    if project != "ok":
        raise RuntimeError(f"the project does not import here: {project}")


def quanto_build(ctx: Ctx, status: Path) -> None:
    """Compile quanto's CUDA extension now (Marlin fp8 / int4 kernels; ~100 s on a fresh machine),
    writing "building", then "ok: ..." or "failed: ..." to ``status``."""
    start = time.time()
    if ctx.dry_run or not torch.cuda.is_available():
        status.write_text("ok: nothing to build (no CUDA)\n")
        ctx.emit("quanto_build", status="nothing to build (no CUDA)")
        return
    status.write_text("building\n")
    try:
        from optimum.quanto.library.extensions import get_extension, is_extension_available

        if not is_extension_available("quanto_cuda"):
            result = "ok: quanto registers no CUDA extension here"
        else:
            get_extension("quanto_cuda").lib
            result = f"ok: built in {time.time() - start:.0f} s"
    except Exception as exc:  # the status file carries it to the stages that need the kernels
        traceback.print_exc()
        result = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    status.write_text(result + "\n")
    ctx.emit("quanto_build", status=result, wall_s=round(time.time() - start, 1))


# =========================================================================== step time


# The levers of issue 45 on Qwen-Image (each its own stage, in order of value): the step without recompute, the
# whole transformer compiled once with CUDA graphs, and fp8 W8A8 for the frozen linears. Each is the config
# keys it sets on top of the engine's defaults; ``checkpointing`` False is gradient_checkpointing: false.
NO_RECOMPUTE: List[str] = []
WHOLE_MODEL = ["compile=true", "compile_mode=model_cudagraphs"]
FP8_W8A8 = ["quantize=true", "quantization.backend=torchao", "quantization.weights=float8_w8a8"]


def step(ctx: Ctx, family: str, compile: str = "auto", attention: str = "auto", checkpointing: bool = True,
         extra: Sequence[str] = (), variant: str = "") -> None:
    """LoRA steps of ``family`` (``compile``: the engine's auto, off, or on; ``attention``: the engine's measured
    choice, or one backend; ``extra``: config keys of a lever, named ``variant``), then one step profiled: the
    record says s/step, host ms, GPU busy ms and its breakdown, MFU and HFU (``harness.step_anatomy``)."""
    overrides = {"off": ["compile=false"], "on": ["compile=true"]}.get(compile, []) + (
        [f"attention_backend={attention}"] if attention != "auto" else []) + list(extra)
    with dry_run_compile(ctx), harness.rig_session(family, ctx.device, torch.bfloat16, scale=ctx.scale,
                                                   overrides=overrides, checkpointing=checkpointing,
                                                   resolution=ctx.resolution) as rig:
        ctx.emit("build", family=family, variant=variant, build_s=round(rig.build_seconds, 1),
                 load_peak_gib=rig.load_peak_gib, compiled=rig.compiled, attention=rig.attention.name,
                 attention_reason=rig.attention.reason)
        report = harness.run_steps(rig, ctx.steps, ctx.resolution)
        targeted = family in sections.TARGET_FAMILIES and compile == "auto" and checkpointing and not extra
        emit_step(ctx, rig, report, family, variant=variant or ("today" if targeted else ""), compile=compile,
                  target_s=TARGET_S if targeted else None, settings=overrides)


def emit_step(ctx: Ctx, rig: harness.Rig, report: harness.StepReport, family: str, variant: str,
              target_s: Optional[float] = None, **fields: Any) -> None:
    """The ``step`` record of a measured run (its anatomy from one profiled step) and the ``profile`` record
    (the profile's summary: the breakdown and the top kernels), each written as it comes."""
    seconds = report.median_step_s
    timing = harness.step_anatomy(rig, report).fields()  # host ms, MFU, HFU: no profile needed
    ctx.emit("step", family=family, title=sections.FAMILY_NAMES[family], variant=variant,
             checkpointing=rig.cfg.gradient_checkpointing, compiled=rig.compiled,
             compile_mode=rig.cfg.compile_mode, first_step_s=round(report.step_times[0], 2),
             step_times=[round(t, 4) for t in report.step_times], host_times=[round(t, 4) for t in report.host_times],
             peak_gib=report.peak_gib, reserved_gib=report.reserved_gib, image_tokens=report.image_tokens,
             text_tokens=report.text_tokens, attention=report.attention, losses=report.losses,
             finite=report.finite, device=ctx.device_name, resolution=ctx.resolution, steps=ctx.steps,
             target_s=target_s, meets=(seconds <= target_s) if target_s is not None else None,
             **{k: v for k, v in timing.items() if k not in ("gpu_busy_ms", "gpu_busy_of_step", "bound")}, **fields)
    profile = harness.profile_step(rig, ctx.resolution, warmup=False)  # after the timed steps: warm already
    anatomy = harness.step_anatomy(rig, report, profile)
    ctx.emit("anatomy", family=family, title=sections.FAMILY_NAMES[family], variant=variant,
             device=ctx.device_name, **anatomy.fields())
    ctx.emit("profile", family=family, title=sections.FAMILY_NAMES[family], variant=variant,
             s_per_step=round(seconds, 4), **profile.summary())


@contextlib.contextmanager
def dry_run_compile(ctx: Ctx) -> Iterator[None]:
    """In a dry run a compiled variant runs the graphs dynamo captures with its ``eager`` backend, op by op: inductor
    takes minutes on a CPU, and even ``aot_eager``'s tracing of the backward took 3-4 s more per compiled stage (the
    dry run checks the pass's plumbing; tests/test_platform_wiring.py checks the compiled step itself, with
    inductor). On the GPU nothing changes."""
    if not ctx.dry_run:
        yield
        return
    original = torch.compile
    torch.compile = functools.partial(original, backend="eager")
    try:
        yield
    finally:
        torch.compile = original


# =========================================================================== memory profiles


def memory(ctx: Ctx, profile: str, steps: int) -> None:
    """A low-memory profile's YAML as the engine builds it: load / train / device peaks against the
    budget and the planner, and its s/step (FLUX.2 [klein]: MFU too, and its own goals)."""
    family = harness.PROFILE_FAMILIES.get(profile, "qwen_image")
    rep = harness.memory_profile(profile, ctx.device, scale=ctx.scale, resolution=ctx.resolution,
                                 steps=steps if not ctx.dry_run else 3, anatomy=True)
    s = rep.steps.median_step_s
    fields: Dict[str, Any] = {}
    if family == "flux2":
        flops = harness.family_flops("flux2", ctx.resolution, ctx.scale)
        peak = max(x for x in (rep.device_peak_gib, rep.load_peak_gib, 0.0) if x is not None)
        mfu = harness.mfu(flops, s, harness.peak_bf16_tflops(ctx.device_name))
        fields = {"tflop_per_step": round(flops.training / 1e12, 2), "mfu": mfu, "goal_gib": FLUX2_GOAL_GIB,
                  "goal_mfu": FLUX2_GOAL_MFU, "meets_memory_goal": peak <= FLUX2_GOAL_GIB if rep.device_peak_gib else None,
                  "meets_mfu_goal": (mfu >= FLUX2_GOAL_MFU) if mfu is not None else None}
    ctx.emit("memory", profile=profile, yaml=harness.PROFILES[profile][0], family=family, budget_gib=rep.budget_gib,
             blocks_to_swap=rep.blocks_to_swap, load_peak_gib=rep.load_peak_gib, train_peak_gib=rep.train_peak_gib,
             device_peak_gib=rep.device_peak_gib, within_budget=rep.within_budget, planned_gib=rep.planned_gib,
             plan_error=rep.plan_error, s_per_step=round(s, 4), first_step_s=round(rep.steps.step_times[0], 2),
             step_times=[round(t, 4) for t in rep.steps.step_times], losses=rep.steps.losses,
             finite=rep.steps.finite, compiled=rep.compiled, device=ctx.device_name, resolution=ctx.resolution,
             **fields)
    if rep.anatomy is not None:
        ctx.emit("anatomy", family=family, title=f"{profile} profile", variant=profile, device=ctx.device_name,
                 **rep.anatomy.fields())
        ctx.emit("profile", family=family, title=f"{profile} profile", variant=profile, s_per_step=round(s, 4),
                 **rep.anatomy.profile.summary())


# =========================================================================== what else fits


def attention(ctx: Ctx) -> None:
    """Each SDPA kernel forced alone on Qwen-Image's and FLUX.1-dev's attention at 1024^2."""
    for family in sections.one_per_transformer(["qwen_image", "flux"]):
        rep = harness.compare_attention_backends(family, ctx.device, torch.bfloat16, ctx.resolution, scale=ctx.scale)
        ctx.emit("attention", family=family, title=sections.FAMILY_NAMES[family], shape=list(rep.shape),
                 auto=rep.auto, fastest=rep.fastest, auto_is_fastest=rep.auto_is_fastest(), device=ctx.device_name,
                 results=[{"name": r.name, "ms": r.ms, "out_error": r.out_error, "grad_error": r.grad_error,
                           "correct": r.correct(rep.tolerance), "failure": r.failure} for r in rep.results])
        sections.free_memory()


def startup(ctx: Ctx) -> None:
    """A tiny run of ``train.py`` as a user starts it, twice (first run, then with the cache on disk):
    wall time and the engine's own phase timings."""
    from image_datasets.sample_data import make_sample_dataset
    from utils.tiny_models import build_tiny_pipeline

    precision = "no" if ctx.device.type == "cpu" else "bf16"
    with tempfile.TemporaryDirectory(prefix="gpu-pass-startup-") as tmp:
        model = build_tiny_pipeline("qwen_image", Path(tmp) / "model", seed=0)
        data = make_sample_dataset(Path(tmp) / "data", size=64, count=6)
        for cache in ("first run", "cache on disk"):
            wall, summary = sections.tiny_train_run([sys.executable], Path(tmp), model, data, precision)
            phases = summary.get("wall_seconds", {})
            ctx.emit("startup", launcher="python", cache=cache, wall_s=round(wall, 1), device=ctx.device_name,
                     first_step_s=summary.get("first_step_s"),
                     phases={k: phases.get(k) for k in sections.STARTUP_PHASES})


def report_section(ctx: Ctx, section: str, build: Callable[[Any], str]) -> None:
    """One of the report's sections, as the markdown it writes."""
    ctx.emit("markdown", section=section, device=ctx.device_name, text=build(ctx.report_run(section, ["qwen_image"])))


def report(ctx: Ctx) -> None:
    """The sections ``benchmarks/gpu_report.py`` asked for (its options: ``--report-args``), one markdown
    record each, in the report's order, each the moment it is written."""
    argv = shlex.split(ctx.report_args)
    args = sections.parse_args(argv)
    if args.dry_run != ctx.dry_run:
        raise SystemExit(f"report: --report-args {ctx.report_args!r} and the pass disagree on --dry-run")
    run = sections.make_run(args, argv)
    sections.quiet_logs()
    for name in sections.SECTIONS:
        if name in args.sections:
            start = time.perf_counter()
            text = sections.BUILDERS[name](run)
            ctx.emit("markdown", section=name, device=ctx.device_name, text=text,
                     seconds=round(time.perf_counter() - start, 1))


MEASUREMENTS: Dict[str, Callable[[Ctx], None]] = {
    "machine": machine,
    "qwen_step": lambda ctx: step(ctx, "qwen_image", "auto"),
    "qwen_no_recompute": lambda ctx: step(ctx, "qwen_image", checkpointing=False, variant="no recompute"),
    "qwen_whole_model": lambda ctx: step(ctx, "qwen_image", checkpointing=False, extra=WHOLE_MODEL,
                                         variant="no recompute, whole model compiled, CUDA graphs"),
    "qwen_fp8": lambda ctx: step(ctx, "qwen_image", checkpointing=False, extra=FP8_W8A8,
                                 variant="no recompute, fp8 W8A8 frozen linears"),
    "mem_24gb": lambda ctx: memory(ctx, "24gb", 5),
    "mem_16gb": lambda ctx: memory(ctx, "16gb", 5),
    "flux2_klein": lambda ctx: memory(ctx, "flux2_klein", 8),
    "krea2_24gb": lambda ctx: memory(ctx, "krea2_24gb", 5),
    "qwen21_24gb": lambda ctx: memory(ctx, "qwen21_24gb", 5),
    "attention": attention,
    "flux_step": lambda ctx: step(ctx, "flux", "auto"),
    "flux_compiled": lambda ctx: step(ctx, "flux", "on", variant="compiled (compile: true)"),
    # FLUX.1-dev compiled with the cuDNN kernel hit an illegal memory access on an H200 (a8112a6): the
    # same step with flash attention, and eager with cuDNN, say which of the two it needs.
    "flux_step_flash": lambda ctx: step(ctx, "flux", "auto", attention="flash"),
    "flux_eager": lambda ctx: step(ctx, "flux", "off"),
    "qwen_eager": lambda ctx: step(ctx, "qwen_image", "off"),
    "edit_step": lambda ctx: step(ctx, "qwen_image_edit", "auto"),
    "startup": startup,
    "loading": lambda ctx: report_section(ctx, "loading", sections.loading_section),
    "fp8": lambda ctx: report_section(ctx, "fp8", sections.fp8_section),
    "report": report,
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(MEASUREMENTS) + ["quanto_build"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--status", type=Path, help="quanto_build: the status file to write")
    parser.add_argument("--report-args", default="", help="report: benchmarks/gpu_report.py's options (one string)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = context(args.name, args.out, args.dry_run)
    ctx.report_args = args.report_args
    try:
        if args.name == "quanto_build":
            quanto_build(ctx, args.status)
        else:
            MEASUREMENTS[args.name](ctx)
    except Exception as exc:  # recorded, so the pass's table shows the failure with its message
        traceback.print_exc()
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        ctx.emit("error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                 out_of_memory=oom, where=traceback.format_exc().splitlines()[-3:][0].strip()[:200])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
