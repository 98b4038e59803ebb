"""The GPU pass's ground floor: its stage table and its results file (one JSON record a line).

Torch-free and importing no other benchmark module, so the pass (``benchmarks/gpu_pass.py``), its
measurements (``benchmarks/gpu_pass_measure.py``) and the one writer of the docs' rows
(``benchmarks/gpu_pass_docs.py``) all read it and none imports another back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

from utils.relative_paths import relative

# The raw files of one pass, in its --out folder.
RESULTS, LOG, TESTS, JUNIT, MACHINE = "results.jsonl", "pass.log", "tests.txt", "junit.xml", "machine.txt"
DOCS_OUT = {"GPU_RESULTS": "GPU_RESULTS.pass.md", "LOW_MEMORY": "LOW_MEMORY.pass.md"}
TARGET_S_PER_STEP = 0.45  # issue 10: H100, 1024^2, batch 1, checkpointing on (Qwen-Image and FLUX.1-dev)


@dataclass(frozen=True)
class Stage:
    """One process of the pass. ``estimate_s`` (on an H100, process start included) decides whether
    it still fits; ``cap_s`` is its hard limit. The ``dry_`` figures are for the CPU dry run."""

    name: str
    group: int  # the item: 1 tests, 2 Qwen-Image step, 3 profiles, 4 FLUX.2, 5 what fits
    title: str
    estimate_s: float
    cap_s: float
    dry_estimate_s: float
    dry_cap_s: float
    kind: str = "measure"  # measure (gpu_pass_measure.py NAME) | tests | int8 | repro (flux_compile_repro.py)
    needs_quanto: bool = False
    on_demand: bool = False  # run only when named (--stages): not part of the whole pass


# Estimates from what an H100 showed at f24b9c6 (../shared/gpu-runs) and the 16-core machine:
# - a process importing torch + diffusers and making its CUDA context: ~10 s;
# - a full-size random-weight model built on the GPU: Qwen-Image 20B ~5 s (gradient-flow tests: 3 builds
#   and steps in ~33 s), FLUX.2 klein 4B ~2 s; on the host (quantized profiles) ~15 s more (40 GB copied
#   off the GPU into pageable memory), then `place` quantizes 60 blocks (~15 s);
# - the first compiled step: 26.6 s (the peer's Qwen-Image step with compiled blocks), then ~0.6 s/step;
#   FLUX has two block types (double and single stream), so two graphs to compile;
# - the 24 GB profile's eager quanto step ~2 s; the 16 GB profile adds 24 swapped blocks per pass;
# - torch.profiler over 3 Qwen-Image steps ~3 s each plus its tables: ~25 s;
# - quanto's CUDA extension: ~100 s to compile (qint4 tiny run 148 s against 44 s for qfloat8), in the
#   background from the start, so stage 1's quanto tests wait for it and stage 3 finds it built;
# - stage 1 runs its tests in 4 xdist workers side by side: the FSDP test's two accelerate launches
#   and the compile test (~30 s of compilation) dominate; the issue caps it at 2 minutes.
STAGES: Sequence[Stage] = (
    Stage("machine", 0, "machine, versions, commit", 10, 30, 10, 60),
    Stage("tests", 1, "quick tests of every CUDA-only path", 110, 120, 40, 150, kind="tests"),
    # Each step stage profiles one step after its timed ones (~10 s at full size): a8112a6's qwen_step took 41 s.
    Stage("qwen_step", 2, "Qwen-Image LoRA 1024^2, checkpointing + compile (today)", 55, 160, 25, 150),
    # Issue 45's levers, in order of value: no recompute (fits 80 GB), the whole model compiled once with CUDA
    # graphs (one graph per pass: less host work), fp8 W8A8 for the frozen linears.
    Stage("qwen_no_recompute", 2, "Qwen-Image LoRA 1024^2, no checkpointing, compiled blocks", 55, 150, 25, 150),
    Stage("qwen_whole_model", 2, "Qwen-Image LoRA 1024^2, no checkpointing, whole model compiled + CUDA graphs",
          90, 200, 60, 240),
    Stage("qwen_fp8", 2, "Qwen-Image LoRA 1024^2, no checkpointing, fp8 W8A8 frozen linears", 65, 150, 30, 150),
    # One layer's int8 vs bf16 matmul time is cheap and decides issue 35's profile choice: before item 3.
    Stage("int8_layer", 2, "int8 and fp8 W8A8 vs bf16: one layer at Qwen-Image widths", 35, 70, 20, 90, kind="int8"),
    # auto_fit chooses torchao's W8A8 for both profiles now (a6c9b66): quanto's kernels are not needed.
    Stage("mem_24gb", 3, "24 GB profile: device peak and s/step", 65, 140, 25, 120),
    Stage("mem_16gb", 3, "16 GB profile: device peak and s/step", 75, 150, 25, 120),
    # FLUX.1-dev's compiled backward hit an illegal memory access on an H200 (a8112a6, c7bf323): whether it works
    # now, then the smallest reproduction (benchmarks/flux_compile_repro.py, one process per variant).
    Stage("flux_compiled", 3, "FLUX.1-dev LoRA 1024^2, checkpointing, compile: true", 55, 110, 25, 120),
    Stage("flux_repro", 3, "FLUX.1-dev compiled backward: the smallest failing variant", 100, 150, 150, 320,
          kind="repro"),
    Stage("flux2_klein", 4, "FLUX.2 [klein] 4B profile: step, peak, MFU", 65, 120, 20, 120),
    # Before the quanto stages of its group: quanto's extension builds meanwhile. Measured on an H100:
    # 73 s for Krea 2's three tests (aa54b89), 30 s for Qwen-Image-2.1's (75294e7).
    Stage("families", 4, "new families' GPU tests: real-width gradients, 1024^2 steps, gradient flow", 80, 240,
          40, 150, kind="tests"),
    # Measured on an H100: 47 s (aa54b89) and 35 s (75294e7).
    Stage("krea2_24gb", 4, "Krea 2 24 GB profile (qfloat8 blocks): step, peak", 55, 140, 20, 120, needs_quanto=True),
    Stage("qwen21_24gb", 4, "Qwen-Image-2.1 24 GB profile (qfloat8 blocks): step, peak", 45, 130, 20, 120,
          needs_quanto=True),
    Stage("int8", 5, "int8 and fp8 W8A8 vs bf16 vs qfloat8 LoRA steps (quantized_step.py)", 90, 150, 30, 120,
          kind="int8"),
    Stage("attention", 5, "attention backends (Qwen-Image, FLUX.1-dev)", 25, 60, 15, 60),
    Stage("flux_step", 5, "FLUX.1-dev LoRA 1024^2, checkpointing + compile", 55, 110, 20, 120),
    Stage("flux_step_flash", 5, "FLUX.1-dev LoRA 1024^2, checkpointing + compile, flash attention", 50, 80, 20, 120),
    Stage("flux_eager", 5, "FLUX.1-dev LoRA 1024^2, checkpointing, eager", 40, 70, 20, 120),
    Stage("qwen_eager", 5, "Qwen-Image LoRA 1024^2, checkpointing, eager", 35, 80, 20, 120),
    Stage("edit_step", 5, "Qwen-Image-Edit LoRA 1024^2, checkpointing + compile", 65, 120, 20, 120),
    Stage("startup", 5, "start-up of a tiny train.py run", 45, 90, 30, 120),
    Stage("loading", 5, "load time per loader (12 full-width Qwen-Image blocks)", 75, 120, 20, 120),
    Stage("fp8", 5, "torchao float8 vs bf16, both compiled", 110, 150, 15, 60),
    # benchmarks/gpu_report.py's sections (its --report-args choose them), one markdown record each; every family
    # with three step variants at full size takes most of an hour, so only named, never in the whole pass.
    Stage("report", 6, "gpu_report.py's sections (machine, steps, memory, attention, fp8, loading, startup)",
          1800, 4 * 3600, 120, 1800, on_demand=True),
)
STAGE_NAMES = [s.name for s in STAGES]
# Named selections of stages (--preset): issue 45's pass, the measurements that explain the step and its levers.
PRESETS: Dict[str, Sequence[str]] = {
    "levers": ("machine", "qwen_step", "qwen_no_recompute", "qwen_whole_model", "qwen_fp8", "mem_24gb", "mem_16gb",
               "flux_compiled", "flux_repro"),
}


# =========================================================================== records


def append_record(path: Path, record: Dict[str, Any]) -> None:
    """One JSON line, appended and flushed at once (a killed stage keeps every earlier line). Paths of
    the machine that ran it are written relative (``utils/relative_paths.py``): results get committed."""
    line = relative(json.dumps(record, default=str, allow_nan=True))
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_records(path: Path) -> List[Dict[str, Any]]:
    """Every complete record of a results file (a torn last line is ignored)."""
    out = []
    if not Path(path).is_file():
        return out
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
