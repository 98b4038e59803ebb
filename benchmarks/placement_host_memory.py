"""Host memory while the streamed transformer leaves the host block by block, side by side for the
two orders `trainer/model/quantization.py::place` could use: the small non-block layers last (before) or
first (now).

The streamed loader fills the model with memory-mapped views of the checkpoint's shards; a shard's
mapping (and its resident pages) is released only when no tensor views it any more. A move to the
GPU reads each tensor and drops its view; with no GPU here, each module is copied away exactly as
``Module.to`` does (``module._apply``), so the file-backed RSS of this process is the host cost a GPU
run would see. Each order runs in a fresh subprocess.

    OMP_NUM_THREADS=1 python benchmarks/placement_host_memory.py [--layers 8] [--shard-size 150MB]

Results: docs/LOW_MEMORY.md (observation 5) and docs/MEMORY_PLANNER.md (host, transformer load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2**20
ORDERS = ("rest_last", "rest_first")

PROBE = """
import json, sys, torch
from diffusers import QwenImageTransformer2DModel
from trainer.model.quantization import largest_module_list
from utils.fast_loading import load_model_streamed

def file_rss():
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024

model = load_model_streamed(QwenImageTransformer2DModel, sys.argv[1], "transformer", dtype=torch.bfloat16)
blocks = largest_module_list(model)
in_blocks = {id(m) for b in blocks for m in b.modules()}
rest = [m for m in model.modules() if id(m) not in in_blocks]
away = lambda t: t.clone()  # what a move to another device does to the host copy: read it, drop it
base, peak = file_rss(), 0
if sys.argv[2] == "rest_first":
    for m in rest:
        m._apply(away, recurse=False)
for block in blocks:
    block._apply(away)
    peak = max(peak, file_rss() - base)
if sys.argv[2] == "rest_last":
    for m in rest:
        m._apply(away, recurse=False)
print(json.dumps({"peak_file_rss": peak, "end_file_rss": file_rss() - base}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--shard-size", default="150MB")
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args(argv)
    if not Path("/proc/self/status").exists():
        print("needs Linux /proc (RssFile)", file=sys.stderr)
        return 2
    from benchmarks.make_synthetic_checkpoint import make_synthetic_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        info = make_synthetic_checkpoint(Path(tmp), "qwen_image", num_layers=args.layers, num_heads=args.heads,
                                         dtype="bf16", max_shard_size=args.shard_size)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        results = {}
        for order in ORDERS:
            proc = subprocess.run([sys.executable, "-c", PROBE, tmp, order], capture_output=True, text=True,
                                  env=env, cwd=ROOT, check=True)
            results[order] = json.loads(proc.stdout.strip().splitlines()[-1])
    shard, total = info["largest_shard_bytes"], info["total_bytes"]
    print(f"checkpoint: {total / MIB:.0f} MiB bf16 in {len(info['files'])} shards "
          f"(largest {shard / MIB:.0f} MiB), {args.layers} blocks")
    print(f"{'order':<12}{'peak file-backed RSS (MiB)':>28}{'x largest shard':>18}{'x checkpoint':>15}")
    for order, r in results.items():
        peak = r["peak_file_rss"]
        print(f"{order:<12}{peak / MIB:>28.0f}{peak / shard:>18.2f}{peak / total:>15.2f}")
    ratio = results["rest_first"]["peak_file_rss"] / max(results["rest_last"]["peak_file_rss"], 1)
    print(f"rest_first / rest_last: {ratio:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"checkpoint": {"total_bytes": total, "largest_shard_bytes": shard,
                                                       "files": len(info["files"])}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
