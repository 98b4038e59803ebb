"""The smallest reproduction of FLUX.1-dev's failing compiled backward ("CUDA error: an illegal memory access", H200,
torch 2.11, a8112a6 with cuDNN attention and c7bf323 with flash attention; ``docs/GPU_RESULTS.md``).

    python benchmarks/flux_compile_repro.py --out DIR            # every variant, one process each (a GPU)
    python benchmarks/flux_compile_repro.py --variant compiled_ckpt   # one variant here, its result on stdout
    python benchmarks/flux_compile_repro.py --out DIR --dry-run  # the same on tiny models on the CPU

Each variant trains two LoRA steps of FLUX.1-dev cut to two double-stream and two single-stream blocks at the real
width (``harness.QUICK``: the real kernels and shapes, random weights, nothing downloaded) at 1024^2, with
``CUDA_LAUNCH_BLOCKING=1`` so that the error names the kernel launch that faults, in its own process (an illegal
memory access leaves the CUDA context unusable). The variants split the suspects: compile with checkpointing (what
failed), compile without checkpointing, compile with checkpointing and the math attention kernel, and eager with
checkpointing (the control, which ran at f24b9c6). Each result is appended to ``DIR/results.jsonl`` (kind
``repro``) as it comes: status, the error's first line, the frame it came from, torch's version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

# name -> (config keys, what it tells). Order: the failing configuration first, then what isolates it.
VARIANTS: Dict[str, tuple] = {
    "compiled_ckpt": (["compile=true", "gradient_checkpointing=true"], "what failed on the H200"),
    "compiled_no_ckpt": (["compile=true", "gradient_checkpointing=false"], "the compiled blocks without recompute"),
    "compiled_ckpt_math": (["compile=true", "gradient_checkpointing=true", "attention_backend=math"],
                           "no fused attention kernel"),
    "eager_ckpt": (["compile=false", "gradient_checkpointing=true"], "the control: eager"),
}
STEPS = 2


def run_variant(name: str, dry_run: bool) -> Dict[str, Any]:
    """Two LoRA steps of the variant here; returns its result (never raises)."""
    import torch

    from benchmarks import harness
    from benchmarks.gpu_pass_measure import Ctx, dry_run_compile

    keys, _ = VARIANTS[name]
    device = torch.device("cpu" if dry_run else "cuda")
    scale, resolution = (harness.TINY, 64) if dry_run else (harness.QUICK, 1024)
    ctx = Ctx(name, Path("."), dry_run, device, scale, resolution, STEPS, time.time())
    result: Dict[str, Any] = {"variant": name, "settings": keys, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "device": harness.device_name(device)}
    try:
        with dry_run_compile(ctx), harness.rig_session("flux", device, torch.bfloat16, scale=scale,
                                                       overrides=[k for k in keys if "checkpointing" not in k],
                                                       checkpointing="gradient_checkpointing=true" in keys,
                                                       resolution=resolution) as rig:
            report = harness.run_steps(rig, STEPS, resolution)
            result.update(status="ok", compiled=rig.compiled, attention=rig.attention.name, losses=report.losses,
                          finite=report.finite)
    except Exception as exc:  # the point of the script: what failed, where
        frames = traceback.extract_tb(exc.__traceback__)
        result.update(status="failed", error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}",
                      where=[f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-6:]])
    return result


def run_all(out: Path, budget_s: float, dry_run: bool) -> List[Dict[str, Any]]:
    """Every variant in its own process, in order, while the budget lasts; each result appended as it comes."""
    from benchmarks.gpu_pass_stages import RESULTS, append_record

    start, results = time.time(), []
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONUNBUFFERED": "1"}
    for name, (_, tells) in VARIANTS.items():
        left = budget_s - (time.time() - start)
        if left < 20:
            append_record(out / RESULTS, {"kind": "repro", "stage": "flux_repro", "variant": name,
                                          "status": "skipped: no time left"})
            continue
        cmd = [sys.executable, __file__, "--variant", name, *(["--dry-run"] if dry_run else [])]
        t0 = time.time()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            line = next((l for l in reversed(done.stdout.splitlines()) if l.startswith("{")), None)
            result = json.loads(line) if line else {"variant": name, "status": f"crashed (exit {done.returncode})",
                                                    "error": (done.stderr or done.stdout).strip()[-600:]}
        except subprocess.TimeoutExpired:
            result = {"variant": name, "status": f"timed out after {left:.0f} s"}
        result.update(tells=tells, wall_s=round(time.time() - t0, 1))
        append_record(out / RESULTS, {"kind": "repro", "stage": "flux_repro", **result})
        print(f"RESULT repro: {name}: {result['status']} {result.get('error', '')[:200]}", flush=True)
        results.append(result)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="run this variant here; its result on stdout")
    parser.add_argument("--out", type=Path, help="folder whose results.jsonl gets every variant's result")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for all variants (default 150)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny models on the CPU, graphs run op by op (dynamo's eager backend)")
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.dry_run), default=str), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required without --variant")
    args.out.mkdir(parents=True, exist_ok=True)
    run_all(args.out, args.budget, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
