"""Measure chosen GPU claims and write them to a markdown file of their own.

    python benchmarks/gpu_report.py                      # all sections, on the GPU, full-size models
    python benchmarks/gpu_report.py --sections steps     # one section (each section names its command)
    OMP_NUM_THREADS=1 python benchmarks/gpu_report.py --dry-run   # tiny models on the CPU, temp file

Sections (``benchmarks/report_sections.py``): machine (GPU, driver, torch / CUDA / cuDNN), step time and MFU
per family at 1024^2 with and without gradient checkpointing and compilation (with a torch.profiler top-kernels
table where a target family is slower than the H100 goal of 0.45 s/step), peak memory and step time of the
24 GB / 16 GB profiles against their budgets and the memory planner (and of the other weight formats and of
block swap), attention backends, fp8 training against bf16, load time per loader, and the start-up of a tiny
run of train.py. The models are full-size random-weight transformers (``benchmarks/harness.py``); nothing is
downloaded.

This command measures nothing itself: the GPU pass (``benchmarks/gpu_pass.py``, the one program that runs
measurements) runs its ``report`` stage with these options, in a process of its own under a time limit, and
this command writes the report from that stage's records. The pass's raw files (``results.jsonl``,
``pass.log``) stay beside the report, in ``<report>.pass/``.

The report goes to ``--out`` (default ``output/gpu_report/GPU_REPORT-<time>.md``), never into docs/:
``docs/GPU_RESULTS.md`` has one writer, ``benchmarks/gpu_pass_docs.py --apply``, fed by the GPU pass.

``--dry-run`` runs every section on tiny models on the CPU and writes a temporary file (its path is
printed), so the script itself is testable without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_pass, harness  # noqa: E402
from benchmarks.gpu_pass_stages import RESULTS, STAGES, TARGET_S_PER_STEP, read_records  # noqa: E402
# Re-exported: the sections lived here, and scripts and tests read them through this module.
from benchmarks.report_sections import (  # noqa: E402,F401
    BUILDERS, DEFAULT_OUT_DIR, FAMILY_NAMES, MEMORY_ROWS, SECTIONS, STARTUP_PHASES, TARGET_FAMILIES, Run, StepRow,
    free_memory, make_run, one_per_transformer, parse_args, quiet_logs, run_scale, tiny_train_run)
from utils.files import write_text_atomic  # noqa: E402

REPORT_STAGE = "report"
PASS_RESERVE_S = 60.0  # the pass's own start and summary, on top of the stage's limit


def header(run: Run, commit: str) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kind = ("**Dry run**: tiny models on the CPU; these numbers say nothing about a GPU."
            if run.dry_run else "Full-size random-weight transformers (no download) on the GPU.")
    return (f"# GPU results\n\nWritten by `benchmarks/gpu_report.py` (the GPU pass's `{REPORT_STAGE}` stage) on "
            f"{when} at commit {commit} ({harness.device_name(run.device)}). {kind} The pass/fail checks are "
            f"`pytest -m gpu tests/gpu -v`; the issue's goal on an H100: Qwen-Image LoRA and FLUX.1-dev at 1024^2, "
            f"batch 1, checkpointing on, <= {TARGET_S_PER_STEP} s/step.\n")


def output_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if args.dry_run:
        fd, name = tempfile.mkstemp(prefix="GPU_RESULTS-dry-run-", suffix=".md")
        os.close(fd)
        return Path(name)
    return DEFAULT_OUT_DIR / datetime.datetime.now().strftime("GPU_REPORT-%Y%m%d-%H%M%S.md")


def run_report_stage(args: argparse.Namespace, argv: List[str], folder: Path) -> List[Dict[str, Any]]:
    """The pass's report stage with this command's options; its records (the pass's start record first)."""
    stage = next(s for s in STAGES if s.name == REPORT_STAGE)
    budget = (stage.dry_cap_s if args.dry_run else stage.cap_s) + PASS_RESERVE_S
    gpu_pass.main(["--stages", REPORT_STAGE, "--out", str(folder), "--budget", str(budget),
                   "--report-args", shlex.join(argv), *(["--dry-run"] if args.dry_run else [])])
    return read_records(folder / RESULTS)


def sections_of(records: List[Dict[str, Any]], folder: Path) -> List[str]:
    """The report stage's markdown sections, in the order they were measured; a stage that failed or stopped
    before writing them ends the command with one line naming why and where its log is."""
    errors = [r for r in records if r.get("kind") == "error" and r.get("stage") == REPORT_STAGE]
    stage = next((r for r in records if r.get("kind") == "stage" and r.get("stage") == REPORT_STAGE), {})
    if errors or stage.get("status") != "ok":
        why = errors[0].get("error") if errors else f"stage {stage.get('status', 'not run')}"
        raise SystemExit(f"gpu_report: the GPU pass's {REPORT_STAGE} stage failed: {why} "
                         f"(its log: {folder / gpu_pass.LOG})")
    return [r["text"] for r in records if r.get("kind") == "markdown" and r.get("stage") == REPORT_STAGE]


def main(argv: Optional[List[str]] = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = make_run(args, argv)  # refuses a missing GPU or a wrong --scale here, before the pass starts
    out = output_path(args)
    folder = out.with_name(out.name + ".pass")
    records = run_report_stage(args, argv, folder)
    commit = next((r.get("commit") for r in records if r.get("kind") == "pass"), "unknown")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "\n".join([header(run, commit), *sections_of(records, folder)]))
    print(f"wrote {out} (the pass's raw files: {folder})")
    return out


if __name__ == "__main__":
    quiet_logs()
    main()
