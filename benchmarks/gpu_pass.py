"""The GPU pass: everything GPU-only measured in ONE device call, ordered by value, each stage in its
own process under its own time cap, every result appended to ``$OUT`` the moment it exists.

    bash benchmarks/gpu_pass.sh                         # on the GPU machine (OUT set by the device tool)
    bash benchmarks/gpu_pass.sh --budget 300            # a shorter call: the stages that fit
    bash benchmarks/gpu_pass.sh --dry-run               # here: every stage on tiny models on the CPU
    python benchmarks/gpu_pass.py --list                # the stages, their estimates and caps

Stages (the issue's order): 1 the CUDA-only paths' quick tests (pass/fail each); 2 Qwen-Image LoRA at
1024^2, checkpointing and compile on, with a profile where it misses 0.45 s/step by more than 20%;
3 the 24 GB and 16 GB profiles' device peaks and s/step; 4 FLUX.2 [klein] 4B step, peak and MFU;
5 what fits of int8 W8A8 (``benchmarks/quantized_step.py``, when present), FLUX.1-dev, attention
backends, Qwen-Image eager, Qwen-Image-Edit, start-up, loading, fp8. A stage whose estimate no longer
fits the budget is recorded as ``skipped: no time left`` and the next one is tried. quanto's CUDA
extension (a ~100 s compile on a fresh machine) builds in the background from the start.

Files in ``--out`` (at most 8, no folders: what the device tool brings back): ``results.jsonl`` (one
JSON record per measurement, test and stage, with each stage's exact command and wall time),
``pass.log`` (every stage's output, capped), ``tests.txt`` and ``junit.xml`` (stage 1),
``machine.txt`` (nvidia-smi, versions), ``GPU_RESULTS.pass.md`` and ``LOW_MEMORY.pass.md`` (the rows
for the docs; ``benchmarks/gpu_pass_docs.py --apply``, the one writer of docs/GPU_RESULTS.md, puts
them in docs/). Every raw file is written with repository-relative paths (``utils/relative_paths.py``):
they can be committed as they are. The last lines printed are a summary table.

This file imports no torch: the measurements run in ``benchmarks/gpu_pass_measure.py`` processes; the
stage table and the results file are ``benchmarks/gpu_pass_stages.py``'s (imported, never importing back).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, TextIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, the repository root is not
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_pass_docs  # noqa: E402  (the one writer of the docs' rows)
from benchmarks.gpu_pass_stages import (DOCS_OUT, JUNIT, LOG, MACHINE, PRESETS, RESULTS, STAGE_NAMES,  # noqa: E402,F401
                                        STAGES, TESTS, Stage, append_record, read_records)
from utils.relative_paths import relative, rewrite, rewrite_folder  # noqa: E402
DEFAULT_BUDGET_S = 460.0  # of the 8 minutes one call may take; the machine's start-up is outside it
END_RESERVE_S = 8.0  # kept back for the docs, the summary and stopping the background build
STAGE_LOG_CAP = 3 * 2**20  # bytes of one stage's output kept in pass.log (then its last lines)
TAIL_LINES = 300
# The FSDP test (two accelerate launches) first: xdist hands the first scopes out one per worker, so
# the slowest starts at once; the xdist groups of test_gpu_quick.py keep the rest on three workers.
QUICK_TESTS = ("tests/gpu/test_fsdp_smoke.py::test_fsdp2_on_one_gpu_trains_resumes_and_exports",
               "tests/gpu/test_gpu_quick.py",
               # The layer test names why, where an 8-bit kernel is refused, and the next one what auto
               # chose; the convergence tests (100 steps at 1024^2) alone outlasted the stage's 120 s cap at
               # 75294e7: not quick.
               "tests/gpu/test_quantized_gpu.py::test_quantized_layer_on_cuda_matches_fp32",
               "tests/gpu/test_quantized_gpu.py::test_the_int8_layout_and_auto_on_this_gpu",
               "tests/test_train_e2e.py::test_steps_on_cuda_make_no_synchronizing_call")
# The families no GPU pass has seen yet: their CUDA gradient/step test at the real width, 10 LoRA steps at
# 1024^2 and the gradient flow on the full-size model (their 24 GB profiles are stages of their own).
# One process, no xdist: two full-size models side by side on one GPU would measure neither.
FAMILY_TESTS = ("tests/gpu/test_gpu_quick.py", "tests/gpu/test_gpu_suite.py",
                "-k", "qwen_image21 and not memory_profile")  # Krea 2: seen at aa54b89 (docs/GPU_RESULTS.md)
INT8_SCRIPT = "benchmarks/quantized_step.py"  # side by side: bf16 / qfloat8 / int8_w8a8 (old, fused) / float8_w8a8


REPRO_SCRIPT = "benchmarks/flux_compile_repro.py"


# =========================================================================== the pass


@dataclass
class Pass:
    out: Path
    work: Path
    budget_s: float
    dry_run: bool
    t0: float  # wall-clock start of the pass (the shell wrapper's, when it set GPU_PASS_T0)
    python: str = sys.executable
    report_args: str = ""  # the report stage's gpu_report.py options (one shell-quoted string)
    log: Optional[TextIO] = None
    build: Optional[subprocess.Popen] = None
    build_log: Optional[Path] = None
    build_started: float = 0.0
    stages_run: List[str] = field(default_factory=list)

    @property
    def results(self) -> Path:
        return self.out / RESULTS

    @property
    def quanto_status(self) -> Path:
        return self.work / "quanto_build.status"

    def elapsed(self) -> float:
        return time.time() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def record(self, kind: str, **fields: Any) -> None:
        append_record(self.results, {"kind": kind, "t": round(self.elapsed(), 1), **fields})

    def say(self, text: str) -> None:
        """A line on stdout (the device tool returns its last 12,000 characters) and in pass.log."""
        print(text, flush=True)
        if self.log is not None:
            self.log.write(relative(text) + "\n")
            self.log.flush()

    def child_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", GPU_PASS_OUT=str(self.out),
                   GPU_PASS_QUANTO_STATUS=str(self.quanto_status), GPU_PASS_T0=str(self.t0))
        if self.dry_run:
            env.update(GPU_PASS_DRY_RUN="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        return env


def commit_of_tree() -> str:
    """The commit the tree was taken from: what ``gpu_pass_prepare.sh`` wrote into .gpu-site/commit
    just before the call, else git, else GPU_PASS_COMMIT. The stamp goes first: the device machine's
    copy carries a .git of the session's first commit under the newer tree (seen at a8112a6)."""
    stamp = ROOT / ".gpu-site" / "commit"
    if stamp.is_file() and stamp.read_text().strip():
        return stamp.read_text().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GPU_PASS_COMMIT", "unknown")


def measure_command(p: Pass, name: str, *extra: str) -> List[str]:
    report = ["--report-args", p.report_args] if name == "report" else []
    return [p.python, "benchmarks/gpu_pass_measure.py", name, "--out", str(p.out),
            *(["--dry-run"] if p.dry_run else []), *report, *extra]


def tests_command(p: Pass, stage: Stage, timeout: float) -> List[str]:
    """pytest for a tests stage: the quick subset in xdist workers, or the new families' tests in one process."""
    cmd = [p.python, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA", "-m", "gpu",
           f"--junitxml={p.out / JUNIT}", "-o", "junit_family=xunit1"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(int(min(110, timeout)))]
    if stage.name == "families":
        return cmd + list(FAMILY_TESTS)
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "2" if p.dry_run else "4", "--dist", "loadgroup"]
    return cmd + list(QUICK_TESTS)


def int8_command(p: Pass, stage: Stage, timeout: float) -> List[str]:
    layer = stage.name == "int8_layer"
    # On the GPU the layer part is timed compiled too (the per-token quantization is elementwise work that
    # compile fuses, as the engine's compiled blocks would); the model part stays eager for time.
    compile_layer = ["--compile", "on"] if layer and not p.dry_run else []
    return [p.python, INT8_SCRIPT, "--device", "cpu" if p.dry_run else "cuda", "--families", "qwen_image",
            "--parts", "layer" if layer else "model", *compile_layer, "--out", str(p.work / f"{stage.name}.md"),
            "--time-budget", str(int(max(10, timeout - 15)))]


# --------------------------------------------------------------------------- running a process


class Pump(threading.Thread):
    """Copies a process's output into pass.log (and tests.txt) line by line, up to a cap, then keeps
    its last lines; echoes the measurement lines (``RESULT ...``) to stdout."""

    def __init__(self, stream: Iterable[str], p: Pass, prefix: str, also: Optional[TextIO] = None):
        super().__init__(daemon=True)
        self.stream, self.p, self.prefix, self.also = stream, p, prefix, also
        self.written = 0
        self.dropped = 0
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)

    def run(self) -> None:
        for line in self.stream:
            if line.startswith("RESULT "):
                print(f"[{self.prefix}] {line.rstrip()[7:]}", flush=True)
            line = relative(line)  # the raw logs get committed: no path of this machine in them
            if self.also is not None:
                self.also.write(line)
                self.also.flush()
            if self.written < STAGE_LOG_CAP:
                self.p.log.write(f"[{self.prefix}] {line}")
                self.p.log.flush()
                self.written += len(line)
            else:
                self.dropped += 1
                self.tail.append(line)

    def finish(self) -> None:
        self.join(timeout=10)
        if self.dropped:
            kept = list(self.tail)
            self.p.log.write(f"[{self.prefix}] ... {self.dropped - len(kept)} lines left out (log cap) ...\n")
            self.p.log.writelines(f"[{self.prefix}] {line}" for line in kept)
            self.p.log.flush()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process's group, then SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_process(p: Pass, prefix: str, cmd: List[str], timeout: float, env: Dict[str, str],
                also: Optional[TextIO] = None) -> Dict[str, Any]:
    """Run ``cmd`` in its own process group; kill the group at ``timeout``. Returns rc, wall, status."""
    start = time.time()
    p.log.write(f"\n===== [{prefix}] {relative(shlex.join(cmd))} (timeout {timeout:.0f} s, at {p.elapsed():.0f} s)\n")
    p.log.flush()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True)
    except OSError as exc:
        return {"rc": None, "wall_s": 0.0, "status": f"failed to start: {exc}"}
    pump = Pump(proc.stdout, p, prefix, also)
    pump.start()
    try:
        rc = proc.wait(timeout=timeout)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        stop_group(proc)
        rc, status = proc.returncode, f"timed out after {timeout:.0f} s (what it wrote before is kept)"
    pump.finish()
    return {"rc": rc, "wall_s": round(time.time() - start, 1), "status": status}


# --------------------------------------------------------------------------- background build


def start_quanto_build(p: Pass) -> None:
    """quanto compiles its CUDA extension (Marlin fp8, int4) on first use, ~100 s on a fresh machine:
    start that now, in its own process, so it overlaps stage 1 instead of eating stage 3."""
    p.build_log = p.work / "quanto_build.log"
    cmd = measure_command(p, "quanto_build", "--status", str(p.quanto_status))
    p.quanto_status.write_text("building\n")
    p.build_started = time.time()
    env = p.child_env()
    env.setdefault("MAX_JOBS", str(max(2, (os.cpu_count() or 4) - 4)))  # leave cores to stage 1
    p.record("stage", stage="quanto_build", group=0, title="quanto CUDA extension build (background)",
             command=shlex.join(cmd), status="started")
    with open(p.build_log, "w") as log:
        p.build = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)


def quanto_state(p: Pass) -> str:
    return p.quanto_status.read_text().strip() if p.quanto_status.is_file() else "unknown"


def finish_quanto_build(p: Pass, final: bool) -> None:
    """Record the build once it has ended (or stop it at the pass's end) and copy its log."""
    if p.build is None:
        return
    if p.build.poll() is None:
        if not final:
            return
        stop_group(p.build)
        # torch's extension builder leaves its lock behind when killed; the next load would wait forever.
        p.quanto_status.write_text("failed: still building when the pass ended\n")
    if quanto_state(p).startswith("building"):  # it died before it could say how it ended
        p.quanto_status.write_text(f"failed: the build process exited with code {p.build.returncode} "
                                   "(its output is in pass.log)\n")
    wall = round(time.time() - p.build_started, 1)
    text = p.build_log.read_text(errors="replace") if p.build_log and p.build_log.is_file() else ""
    p.log.write(relative(f"\n===== [quanto_build] exit {p.build.returncode}, {wall} s\n{text[-200_000:]}\n"))
    p.log.flush()
    p.record("stage", stage="quanto_build", group=0, title="quanto CUDA extension build (background)",
             wall_s=wall, rc=p.build.returncode, status=quanto_state(p))
    p.build = None


def wait_for_build(p: Pass, stage: Stage) -> None:
    """Before a stage that needs quanto's kernels: let the background build finish (it needs them,
    and the builder's CUDA context would count in the stage's device peak), as long as the stage's
    estimate still fits after the wait."""
    waited = time.time()
    while p.build is not None and p.build.poll() is None and \
            p.remaining() - END_RESERVE_S - estimate(p, stage) > 0:
        time.sleep(1.0)
    if time.time() - waited > 1:
        p.say(f"   waited {time.time() - waited:.0f} s for quanto's CUDA extension build")
    finish_quanto_build(p, final=False)


# --------------------------------------------------------------------------- stages


def skip(p: Pass, stage: Stage, why: str, command: str = "") -> None:
    p.record("stage", stage=stage.name, group=stage.group, title=stage.title, command=command,
             estimate_s=estimate(p, stage), status=f"skipped: {why}")
    p.say(f"-- {stage.name}: skipped: {why}")


def estimate(p: Pass, stage: Stage) -> float:
    return stage.dry_estimate_s if p.dry_run else stage.estimate_s


def run_stage(p: Pass, stage: Stage) -> None:
    finish_quanto_build(p, final=False)
    if stage.kind == "int8" and not (ROOT / INT8_SCRIPT).is_file():
        return skip(p, stage, f"{INT8_SCRIPT} is not in this tree (issue 35's branch not merged)")
    if stage.needs_quanto:
        wait_for_build(p, stage)
    if stage.needs_quanto and quanto_state(p).startswith("failed"):
        return skip(p, stage, f"quanto's CUDA extension did not build ({quanto_state(p)[:200]})")
    left = p.remaining() - END_RESERVE_S
    if left < estimate(p, stage):
        return skip(p, stage, f"no time left ({left:.0f} s left, estimate {estimate(p, stage):.0f} s)")
    timeout = min(stage.dry_cap_s if p.dry_run else stage.cap_s, left)
    env = p.child_env()
    also = None
    if stage.kind == "tests":
        cmd = tests_command(p, stage, timeout)
        env["GPU_PASS_QUANTO_DEADLINE"] = str(time.time() + timeout - 25)  # the two quanto tests need ~20 s
        also = open(p.out / TESTS, "a", encoding="utf-8")
    elif stage.kind == "int8":
        cmd = int8_command(p, stage, timeout)
    elif stage.kind == "repro":
        cmd = [p.python, REPRO_SCRIPT, "--out", str(p.out), "--budget", str(int(timeout - 5)),
               *(["--dry-run"] if p.dry_run else [])]
    else:
        cmd = measure_command(p, stage.name)
    p.say(f"-> {stage.name} (group {stage.group}): {stage.title}; estimate {estimate(p, stage):.0f} s, "
          f"limit {timeout:.0f} s, {p.remaining():.0f} s of the budget left")
    try:
        done = run_process(p, stage.name, cmd, timeout, env, also)
    finally:
        if also is not None:
            also.close()
    if stage.kind == "tests":
        record_tests(p, stage.name, done["status"])
    if stage.kind == "int8":
        record_int8(p, stage)
    p.record("stage", stage=stage.name, group=stage.group, title=stage.title, command=shlex.join(cmd),
             estimate_s=estimate(p, stage), timeout_s=round(timeout), **done)
    p.stages_run.append(stage.name)
    p.say(f"<- {stage.name}: {done['status']} in {done['wall_s']} s")


def record_tests(p: Pass, stage_name: str, status: str) -> None:
    """One record per test: from junit.xml when pytest finished, else from its -v lines in tests.txt
    (a stage that timed out); tests never reported are recorded as not finished."""
    if (p.out / JUNIT).is_file():
        rewrite(p.out / JUNIT)  # pytest wrote it with this machine's paths
    tests = parse_junit(p.out / JUNIT) if (p.out / JUNIT).is_file() else None
    source = "junit.xml"
    if tests is None:
        text = (p.out / TESTS).read_text(errors="replace") if (p.out / TESTS).is_file() else ""
        tests, source = parse_verbose(text), "tests.txt"
    for test in tests:
        p.record("test", stage=stage_name, source=source, **test)
    if status != "ok" and not tests:
        p.record("test", stage=stage_name, source="none", id="(the whole subset)", outcome="not finished",
                 message=status)


def parse_junit(path: Path) -> Optional[List[Dict[str, Any]]]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError):
        return None
    out = []
    for case in root.iter("testcase"):
        # xunit1: file + classname ("tests.gpu.test_gpu_quick") + name; rebuild the node id.
        path_ = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path_}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or child.text or "")[:500]
                break
        out.append({"id": node, "outcome": outcome, "duration_s": round(float(case.get("time") or 0), 1),
                    "message": message})
    return out


def parse_verbose(text: str) -> List[Dict[str, Any]]:
    """``pytest -v`` result lines, with or without xdist (``path::test PASSED``, ``[gw0] [ 5%] PASSED
    path::test``, ``-rA``'s ``FAILED path::test - why``): the last outcome per node id wins."""
    import re

    found: Dict[str, Dict[str, Any]] = {}
    pattern = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
    for line in text.splitlines():
        node = next((w for w in line.split() if "::" in w), None)
        word = pattern.search(line)
        if node is not None and word is not None:
            found[node] = {"id": node, "outcome": word.group(1).lower(), "duration_s": None, "message": ""}
    return list(found.values())


def record_int8(p: Pass, stage: Stage) -> None:
    """quantized_step.py's rows: one record per JSON line it wrote, and its markdown table as text."""
    table = p.work / f"{stage.name}.md"
    rows = table.with_name(table.name + ".jsonl")
    if rows.is_file():
        for line in rows.read_text(errors="replace").splitlines():
            try:
                p.record("int8", stage=stage.name, data=json.loads(line))
            except json.JSONDecodeError:
                p.record("int8", stage=stage.name, text=line[:10_000])
    if table.is_file():
        p.record("int8_table", stage=stage.name, text=table.read_text(errors="replace")[:100_000])


# =========================================================================== main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (default: $OUT on the device machine; a new temp folder "
                             "in a dry run)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole pass (default {DEFAULT_BUDGET_S:.0f}); a stage whose "
                             "estimate no longer fits is skipped")
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on tiny models on the CPU (estimates and limits for the CPU)")
    parser.add_argument("--stages", nargs="+", choices=STAGE_NAMES, default=None,
                        help="run only these stages (in the pass's order)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="run a named selection of stages (levers: issue 45's step measurements and levers)")
    parser.add_argument("--list", action="store_true", help="print the stages and exit")
    parser.add_argument("--report-args", default="",
                        help="the report stage's options, as benchmarks/gpu_report.py takes them (one string)")
    return parser.parse_args(argv)


def selected_stages(args: argparse.Namespace) -> List[Stage]:
    """The stages named by --stages and --preset, in the pass's order; none named: the whole pass (every stage
    but the on-demand ones)."""
    wanted = set(args.stages or ()) | set(PRESETS.get(args.preset, ()))
    return [s for s in STAGES if s.name in wanted or (not wanted and not s.on_demand)]


def out_folder(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if not args.dry_run and os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    if args.dry_run:
        return Path(tempfile.mkdtemp(prefix="gpu-pass-dry-"))
    return ROOT / "output" / "gpu_pass" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def list_stages() -> None:
    print(f"{'stage':<18} {'group':>5} {'est. s':>7} {'cap s':>6} {'dry est.':>8} {'dry cap':>8}  what")
    for s in STAGES:
        print(f"{s.name:<18} {s.group:>5} {s.estimate_s:>7.0f} {s.cap_s:>6.0f} {s.dry_estimate_s:>8.0f} "
              f"{s.dry_cap_s:>8.0f}  {s.title}")
    print(f"sum of the estimates: {sum(s.estimate_s for s in STAGES if not s.on_demand):.0f} s (GPU, on-demand "
          "stages not counted); "
          f"budget {DEFAULT_BUDGET_S:.0f} s")


def main(argv: Optional[List[str]] = None) -> Path:
    args = parse_args(argv)
    if args.list:
        list_stages()
        return Path()
    out = out_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    t0 = float(os.environ.get("GPU_PASS_T0") or time.time())
    p = Pass(out, Path(tempfile.mkdtemp(prefix="gpu-pass-work-")), args.budget, args.dry_run, t0,
             report_args=args.report_args)
    p.log = open(out / LOG, "a", encoding="utf-8")
    selected = selected_stages(args)
    p.record("pass", event="start", commit=commit_of_tree(), budget_s=args.budget, dry_run=args.dry_run,
             argv=sys.argv[1:] if argv is None else argv, python=sys.version.split()[0],
             when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             stages=[s.name for s in selected], out=str(out))
    p.say(f"GPU pass{' (DRY RUN, CPU)' if args.dry_run else ''}: {len(selected)} stages, budget {args.budget:.0f} s, "
          f"out {out}")
    try:
        if any(s.needs_quanto or s.kind == "tests" for s in selected):
            start_quanto_build(p)
        for stage in selected:
            run_stage(p, stage)
    finally:
        finish_quanto_build(p, final=True)
        p.record("pass", event="end", wall_s=round(p.elapsed(), 1))
        finish(p)
    return out


def finish(p: Pass) -> None:
    """The docs' rows and the summary table, from results.jsonl (a failure here loses nothing)."""
    try:
        records = read_records(p.results)
        for doc, name in DOCS_OUT.items():
            (p.out / name).write_text(gpu_pass_docs.render(records, doc), encoding="utf-8")
        summary = gpu_pass_docs.summary(records)
    except Exception as exc:  # the raw results are already safe in results.jsonl
        summary = f"(summary failed: {type(exc).__name__}: {exc}; see {RESULTS})"
    p.say("\n" + summary)
    p.log.close()
    rewrite_folder(p.out)  # what a process wrote past the pumps (machine.txt, a stage's own files): relative too


if __name__ == "__main__":
    main()
