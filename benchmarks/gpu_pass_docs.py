"""Turn a GPU pass's ``results.jsonl`` into the docs' rows, and print its summary table.

    python benchmarks/gpu_pass_docs.py RESULTS.jsonl            # print both docs' sections
    python benchmarks/gpu_pass_docs.py RESULTS.jsonl --apply    # put them into docs/GPU_RESULTS.md and
                                                                # docs/LOW_MEMORY.md (between the
                                                                # <!-- gpu-pass:begin/end --> markers)
    python benchmarks/gpu_pass_docs.py RESULTS.jsonl --summary  # the pass's summary table

Every row carries the commit and the device it was measured on. A missed target stays in its table
with its figure; every step row says where its time goes (host ms, GPU busy ms and its breakdown, MFU, HFU)
and is followed by its one profiled step (top kernels). The targets are stated for an H100: on another card the text
says which card it was.

This module is the one writer of ``docs/GPU_RESULTS.md`` (``benchmarks/gpu_report.py`` writes its own
file); it imports the pass's stage table (``benchmarks/gpu_pass_stages.py``), never the pass itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_pass_stages import STAGES, read_records  # noqa: E402

BEGIN, END = "<!-- gpu-pass:begin -->", "<!-- gpu-pass:end -->"
DOCS = {"GPU_RESULTS": ROOT / "docs" / "GPU_RESULTS.md", "LOW_MEMORY": ROOT / "docs" / "LOW_MEMORY.md"}
TITLES = {s.name: s.title for s in STAGES}
Record = Dict[str, Any]


def fmt(value: Any, spec: str = ".2f", none: str = "n/a") -> str:
    if value is None:
        return none
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |"
                              for row in rows])


class Pass:
    """The records of one pass, by kind."""

    def __init__(self, records: List[Record]):
        self.records = records
        start = next((r for r in records if r.get("kind") == "pass" and r.get("event") == "start"), {})
        end = next((r for r in records if r.get("kind") == "pass" and r.get("event") == "end"), {})
        self.machine = next((r for r in records if r.get("kind") == "machine"), {})
        self.commit = start.get("commit", "unknown")
        self.when = start.get("when", "")
        self.dry_run = bool(start.get("dry_run"))
        self.budget = start.get("budget_s")
        self.wall = end.get("wall_s")
        self.device = self.machine.get("gpu") or next((r.get("device") for r in records if r.get("device")), "unknown")

    def of(self, kind: str) -> List[Record]:
        return [r for r in self.records if r.get("kind") == kind]

    def stages(self) -> List[Record]:
        """The last record of each stage (a started background build is superseded by its end)."""
        last: Dict[str, Record] = {}
        for r in self.of("stage"):
            last[r["stage"]] = r
        return list(last.values())

    @property
    def on_h100(self) -> bool:
        return "H100" in str(self.device)

    def where(self) -> str:
        return f"{self.device}, commit {self.commit}"


# =========================================================================== descriptions (summary and docs)


def target_text(s: float, target: Optional[float]) -> str:
    if target is None:
        return ""
    if s <= target:
        return f"meets {target} (H100 target)"
    return f"**misses** {target} (H100 target) by {s / target - 1:+.0%}"


def describe(r: Record) -> str:
    """One line for a measurement record."""
    kind = r.get("kind")
    if kind == "step":
        return (f"{r.get('title')}: {fmt(r.get('s_per_step'), '.3f')} s/step "
                f"({'compiled' if r.get('compiled') else 'eager'}, first {fmt(r.get('first_step_s'), '.1f')} s), "
                f"peak {fmt(r.get('peak_gib'))} GiB, MFU {fmt(r.get('mfu'), '.1%')} "
                f"{target_text(r.get('s_per_step') or 0, r.get('target_s'))}").strip()
    if kind == "memory":
        text = (f"{r.get('profile')}: device peak {fmt(r.get('device_peak_gib'))} GiB "
                f"(load {fmt(r.get('load_peak_gib'))}; budget {fmt(r.get('budget_gib'), '.0f')}, within "
                f"{fmt(r.get('within_budget'))}), {fmt(r.get('s_per_step'), '.3f')} s/step, planner "
                f"{fmt(r.get('plan_error'), '+.0%')}")
        if r.get("goal_gib") is not None:
            text += (f"; goals <= {r['goal_gib']:.0f} GiB: {fmt(r.get('meets_memory_goal'))}, MFU "
                     f"{fmt(r.get('mfu'), '.1%')} >= {r.get('goal_mfu', 0):.0%}: {fmt(r.get('meets_mfu_goal'))}")
        return text
    if kind == "anatomy":
        return (f"{r.get('variant') or r.get('title')}: host {fmt(r.get('host_ms'), '.0f')} ms, GPU busy "
                f"{fmt(r.get('gpu_busy_ms'), '.0f')} ms per step ({r.get('bound')}-bound), MFU {fmt(r.get('mfu'), '.1%')}, "
                f"HFU {fmt(r.get('hfu'), '.1%')}")
    if kind == "profile":
        return ("profile: " + ", ".join(f"{k} {v:.0%}" for k, v in (r.get("shares") or {}).items() if v >= 0.005))
    if kind == "repro":
        return f"{r.get('variant')}: {r.get('status')}{' ' + r['error'][:120] if r.get('error') else ''}"
    if kind == "attention":
        ms = ", ".join(f"{x['name']} {fmt(x.get('ms'))}" for x in r.get("results", []) if x.get("ms") is not None)
        return f"{r.get('title')} attention ms: {ms}; auto {r.get('auto')}, fastest {r.get('fastest')}"
    if kind == "startup":
        return f"tiny train.py ({r.get('cache')}): {fmt(r.get('wall_s'), '.1f')} s wall"
    if kind == "machine":
        return (f"{r.get('gpu')} ({r.get('memory_gib')} GiB, {r.get('capability')}), driver {r.get('driver')}, "
                f"torch {r.get('torch')}, CUDA {r.get('cuda')}, cuDNN {r.get('cudnn')}")
    if kind == "quanto_build":
        return f"quanto CUDA extension: {r.get('status')}"
    if kind == "error":
        return f"ERROR {r.get('error')}"
    if kind == "int8":
        row = r.get("data") if isinstance(r.get("data"), dict) else {}
        keep = ("layer", "kernel", "ms", "out_error", "s_per_step", "train_peak_gib", "mm8_per_step")
        values = ", ".join(f"{k} {fmt(v, '.4g') if isinstance(v, (int, float)) else v}"
                           for k, v in (row.get("values") or {}).items() if k in keep)
        return (f"int8 {row.get('part')} {row.get('family')} {row.get('format')} compile {row.get('compile')}: "
                f"{row.get('status')}{'; ' + values if values else ''}")
    if kind == "int8_table":
        return ""
    if kind == "markdown":
        return f"{r.get('section')} section written"
    if kind == "build":
        return ""
    return kind or ""


def test_counts(p: Pass, stage: str) -> str:
    counts: Dict[str, int] = {}
    for t in p.of("test"):
        if t.get("stage") != stage:
            continue
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test reported"


def summary(records: List[Record]) -> str:
    """A fixed-width table: each stage's status, wall time and main figures, then any failed test."""
    p = Pass(records)
    lines = [f"GPU pass summary{' (DRY RUN on the CPU)' if p.dry_run else ''}: {p.device}, commit {p.commit}, "
             f"wall {fmt(p.wall, '.0f')} s of a {fmt(p.budget, '.0f')} s budget",
             f"{'stage':<18} {'status':<16} {'wall s':>6}  result"]
    for st in p.stages():
        name, status = st["stage"], st.get("status", "")
        short = status.split(":")[0].split(" (what")[0]
        if any(t.get("stage") == name for t in p.of("test")) or name == "tests":
            results = [test_counts(p, name)]
        else:
            results = [d for d in (describe(r) for r in records if r.get("stage") == name and r.get("kind") != "stage")
                       if d]
        if short != status and not results:
            results = [status[len(short):].lstrip(": ")]
        lines.append(f"{name:<18} {short[:16]:<16} {fmt(st.get('wall_s'), '.0f', ''):>6}  " + " | ".join(results))
    bad = [t for t in p.of("test") if t["outcome"] not in ("passed", "skipped")]
    for t in bad:
        lines.append(f"  test {t['outcome']}: {t['id']} {t.get('message', '')[:200]}")
    return "\n".join(lines)


# =========================================================================== markdown


def header(p: Pass, doc: str) -> str:
    m = p.machine
    ver = m.get("versions") or {}
    card = ("" if p.on_h100 else
            f" The targets are stated for an H100; this card is **{p.device}**"
            + (" (an H200 has the H100's compute with more and faster memory: step times compare with an "
               "H100's, and a peak is what the process used, not the card's size)." if "H200" in str(p.device)
               else "."))
    dry = " **Dry run on the CPU: tiny models; these numbers say nothing about a GPU.**" if p.dry_run else ""
    return (f"### GPU pass at commit {p.commit} on {p.device}\n\n"
            f"Measured by `bash benchmarks/gpu_pass.sh` ({p.when}, wall {fmt(p.wall, '.0f')} s of a "
            f"{fmt(p.budget, '.0f')} s budget, one run of the pass): {p.device}, driver {m.get('driver')}, "
            f"torch {m.get('torch')}, CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, diffusers {ver.get('diffusers')}, "
            f"optimum-quanto {ver.get('optimum-quanto')}, bitsandbytes {ver.get('bitsandbytes')}, torchao "
            f"{ver.get('torchao')}; full-size random-weight transformers (nothing downloaded), 1024^2, batch 1, "
            f"LoRA rank 16.{card}{dry} Raw records: the pass's `results.jsonl`.\n")


def stages_md(p: Pass) -> str:
    rows = [(s["stage"], TITLES.get(s["stage"], s.get("title", "")), s.get("status", ""), fmt(s.get("wall_s"), ".0f", ""),
             fmt(s.get("estimate_s"), ".0f", ""), f"`{s.get('command', '')}`" if s.get("command") else "")
            for s in p.stages()]
    return "#### Stages\n\n" + table(("Stage", "What", "Status", "Wall s", "Estimate s", "Command"), rows) + "\n"


def tests_md(p: Pass, only: Optional[Sequence[str]] = None) -> str:
    tests = [t for t in p.of("test") if only is None or any(k in t["id"] for k in only)]
    if not tests:
        return ""
    rows = [(f"`{t['id']}`", t["outcome"] if t["outcome"] in ("passed", "skipped") else f"**{t['outcome']}**",
             fmt(t.get("duration_s"), ".1f", ""), t.get("message", "")[:160]) for t in tests]
    return ("#### Tests on the GPU (stage 1: the CUDA-only paths; `families`: the new families at full size)\n\n"
            + table(("Test", "Outcome", "s", "Message"), rows) + f"\n\nDevice {p.where()}.\n")


STEP_COLUMNS_NOTE = """\
LoRA rank 16 (the families' `attention` preset), AdamW, bf16 autocast, batch 1. How to read a row (the
arithmetic is `benchmarks/step_anatomy.py`, unit-tested on the CPU):

- *s/step*: the median interval between two reads of the loss as the engine runs (the host queues step N+1
  while the GPU runs step N), after two warm-up steps (the first includes the compilation) and **without the
  final flush interval** (with a read-out lag of one, the last interval is the GPU's tail, not a step).
- *Host ms*: the median time the host takes to issue one step (forward, backward, clip, optimizer) without
  waiting for the GPU (perf_counter around the queueing, no synchronisation). Near s/step: the host limits
  the step, and GPU-only speed-ups will not show.
- *GPU busy ms*: the sum of the kernel times of one step profiled with `torch.profiler` after the timed steps
  (overlapping streams would count twice). Near s/step: the GPU limits the step. *Bound* says which of host
  ms and GPU busy ms is larger.
- *GEMM / attention / elementwise / LoRA / optimizer ms*: that profile's kernels by category: GEMMs (cuBLAS,
  cutlass, `_scaled_mm`), attention kernels (flash, cuDNN, memory-efficient), elementwise (pointwise ops,
  norms, reductions, casts, inductor's triton kernels), LoRA (the GEMMs whose shapes show the LoRA rank:
  its scaling and add are elementwise), optimizer (fused AdamW, gradient clipping); copies are in the
  record only.
- *MFU*: model FLOPs per step (`harness.step_flops`: frozen linears 4NT, LoRA 6NT, attention 12 S^2 d per
  block) / (s/step x the card's dense bf16 peak). *HFU*: the same with the recomputed forward of the
  checkpointed blocks counted (the FLOPs the hardware ran); without checkpointing HFU = MFU.
"""


def checkpointed(value: Any) -> str:
    """``gradient_checkpointing`` as a table cell: every block, none, or how many."""
    if value is True:
        return "all blocks"
    if value in (False, 0, None):
        return "none" if value is not None else "n/a"
    return f"{value} blocks"


def steps_md(p: Pass) -> str:
    steps = p.of("step")
    if not steps:
        return ""
    anatomy = {(r.get("stage"), r.get("variant")): r for r in p.of("anatomy")}
    rows = []
    for r in steps:
        a = anatomy.get((r.get("stage"), r.get("variant")), {})
        parts = a.get("breakdown_ms") or {}
        rows.append((r.get("title"), r.get("variant") or r.get("stage"), checkpointed(r.get("checkpointing")),
                     f"{r.get('compile_mode', 'blocks')} ({'compiled' if r.get('compiled') else 'eager'})",
                     fmt(r.get("s_per_step"), ".3f"), fmt(r.get("host_ms"), ".0f"), fmt(a.get("gpu_busy_ms"), ".0f"),
                     a.get("bound", "n/a"), *(fmt(parts.get(k), ".0f") for k in ("gemm", "attention", "elementwise",
                                                                                  "lora", "optimizer")),
                     fmt(r.get("mfu"), ".1%"), fmt(r.get("hfu"), ".1%"), fmt(r.get("peak_gib")),
                     fmt(r.get("first_step_s"), ".1f"), r.get("attention"),
                     target_text(r.get("s_per_step") or 0, r.get("target_s")), r.get("device"), p.commit))
    body = table(("Family", "Variant", "Checkpointing", "Compile", "s/step", "Host ms", "GPU busy ms", "Bound",
                  "GEMM ms", "Attention ms", "Elementwise ms", "LoRA ms", "Optimizer ms", "MFU", "HFU", "Peak GiB",
                  "First step s", "Attention", "Target", "Device", "Commit"), rows)
    return (f"#### Step time, host and GPU time, MFU at {steps[0].get('resolution')}^2\n\n{body}\n\n"
            f"{STEP_COLUMNS_NOTE}" + "".join(profile_md(r) for r in p.of("profile")) + repro_md(p))


def profile_md(r: Record) -> str:
    """One profiled step: its breakdown and its heaviest kernels."""
    rows = [(f"`{k['name'][:90]}`", k["calls"], fmt(k["ms_per_step"], ".1f"), fmt(k["share"], ".1%"), k["category"])
            for k in r.get("top", [])]
    parts = ", ".join(f"{k} {fmt(v, '.1f')} ms" for k, v in (r.get("breakdown_ms") or {}).items())
    unit = r.get("unit", "device")
    what = "GPU busy" if unit == "device" else "CPU op time (a CPU profile: no GPU time)"
    return (f"\n##### Where the time goes: {r.get('title')}, {r.get('variant') or r.get('stage')} "
            f"({fmt(r.get('s_per_step'), '.3f')} s/step)\n\n"
            f"One step under torch.profiler: {what} {fmt(r.get('busy_ms'), '.1f')} ms; {parts}.\n\n"
            + table(("Kernel", "Calls", f"{unit} ms per step", "Share", "Category"), rows) + "\n")


def repro_md(p: Pass) -> str:
    """FLUX.1-dev's compiled backward, variant by variant (benchmarks/flux_compile_repro.py)."""
    runs = p.of("repro")
    if not runs:
        return ""
    rows = [(r.get("variant"), r.get("tells", ""), r.get("status"), r.get("error", ""), " <- ".join(r.get("where", [])),
             r.get("torch", "")) for r in runs]
    return ("\n##### FLUX.1-dev compiled backward: the smallest reproduction (`benchmarks/flux_compile_repro.py`)\n\n"
            "Two LoRA steps of FLUX.1-dev cut to 2 double- and 2 single-stream blocks at the real width, 1024^2, "
            "`CUDA_LAUNCH_BLOCKING=1`, one process per variant.\n\n"
            + table(("Variant", "What it tells", "Status", "Error", "Where", "torch"), rows) + "\n")


def memory_md(p: Pass) -> str:
    mems = p.of("memory")
    if not mems:
        return ""
    rows = [(r.get("profile"), f"`{r.get('yaml')}`", r.get("blocks_to_swap"), fmt(r.get("load_peak_gib")),
             fmt(r.get("train_peak_gib")), fmt(r.get("device_peak_gib")), fmt(r.get("budget_gib"), ".0f"),
             fmt(r.get("within_budget")), fmt(r.get("planned_gib")), fmt(r.get("plan_error"), "+.0%"),
             fmt(r.get("s_per_step"), ".3f"), "compiled" if r.get("compiled") else "eager", r.get("device"), p.commit)
            for r in mems]
    text = ("#### Low-memory profiles: peak memory (GiB) and step time\n\n"
            + table(("Profile", "YAML", "Swapped blocks", "Load peak", "Train peak", "Device peak", "Budget",
                     "Within", "Planner", "Planner error", "s/step", "Blocks", "Device", "Commit"), rows)
            + "\n\nEach profile's YAML as the engine builds it (Qwen-Image, or FLUX.2 [klein] base 4B), 1024^2, "
              "batch 1, 5 steps (FLUX.2: 8). *Load* and *train peak*: `torch.cuda.max_memory_allocated`; *device "
              "peak*: `max_memory_reserved` plus what the process holds outside torch's allocator (CUDA context), "
              "the figure compared with the budget and the planner (goal within +-15%).\n")
    klein = [r for r in mems if r.get("goal_gib") is not None]
    for r in klein:
        text += (f"\nFLUX.2 [klein] base 4B LoRA: {fmt(r.get('s_per_step'), '.3f')} s/step, "
                 f"{fmt(r.get('tflop_per_step'), '.4g')} TFLOP/step, **MFU {fmt(r.get('mfu'), '.1%')}** (goal >= "
                 f"{r.get('goal_mfu', 0):.0%}: {fmt(r.get('meets_mfu_goal'))}), device peak "
                 f"**{fmt(r.get('device_peak_gib'))} GiB** (goal <= {r['goal_gib']:.0f} GiB: "
                 f"{fmt(r.get('meets_memory_goal'))}); {r.get('device')}, commit {p.commit}.\n")
    return text


def attention_md(p: Pass) -> str:
    parts = []
    for r in p.of("attention"):
        rows = [(x["name"] + (" (auto)" if x["name"] == r.get("auto") else ""), fmt(x.get("ms")),
                 fmt(x.get("out_error"), ".1e"), fmt(x.get("grad_error"), ".1e"),
                 "yes" if x.get("correct") else f"**no** {x.get('failure') or ''}") for x in r.get("results", [])]
        parts.append(f"{r.get('title')}: q, k, v {tuple(r.get('shape', ()))}, bf16; the engine's measured auto "
                     f"choice `{r.get('auto')}` {'is' if r.get('auto_is_fastest') else 'is **not**'} the fastest "
                     f"(within 10%), fastest `{r.get('fastest')}`.\n\n"
                     + table(("Backend", "fwd+bwd ms", "out rel. error", "dQ rel. error", "correct"), rows))
    return ("#### Attention backends\n\n" + "\n\n".join(parts) + f"\n\n{p.where()}.\n") if parts else ""


def startup_md(p: Pass) -> str:
    runs = p.of("startup")
    if not runs:
        return ""
    keys = ("imports", "setup", "prepare_data", "setup_model", "train")
    rows = [(r.get("launcher"), r.get("cache"), fmt(r.get("wall_s"), ".1f"),
             *(fmt((r.get("phases") or {}).get(k), ".1f") for k in keys), fmt(r.get("first_step_s"), ".2f"))
            for r in runs]
    return ("#### Start-up of a tiny run (`train.py`, tiny Qwen-Image, 12 steps)\n\n"
            + table(("Launcher", "Cache", "Wall s", "Imports s", "Set-up s", "Data + cache pass s", "Model s",
                     "Train s", "First step s"), rows) + f"\n\n{p.where()}.\n")


def demote(markdown: str) -> str:
    """quantized_step.py's page as part of this one: its title dropped, its sections two levels down."""
    lines = [line for line in markdown.strip().splitlines() if not line.startswith("# ")]
    return "\n".join("#####" + line[2:] if line.startswith("## ") else line for line in lines).strip()


def int8_md(p: Pass) -> str:
    """quantized_step.py's own markdown table where it came back, else its JSON rows as a table."""
    tables = p.of("int8_table")
    rows = [r["data"] for r in p.of("int8") if isinstance(r.get("data"), dict)]
    if not tables and not rows:
        return ""
    out = "#### int8 and fp8 W8A8 against bf16 and qfloat8 (`benchmarks/quantized_step.py`)\n\n"
    if tables:  # one table per stage (the layer part, then the LoRA steps), under this page's headings
        out += "\n".join(demote(t.get("text", "")) + "\n" for t in tables)
    else:
        keys = list(dict.fromkeys(k for x in rows for k in x))
        out += table(keys, [[fmt(x.get(k), ".4g", "") for k in keys] for x in rows]) + "\n"
    return out + f"\n{p.where()}.\n"


def markdown_md(p: Pass) -> str:
    """The report's markdown sections (the loading and fp8 stages, the report stage), their headings moved under
    this pass's."""
    out = ""
    for r in p.of("markdown"):
        text = r.get("text", "").replace("\n## ", "\n#### ").strip()
        body = text[3:] if text.startswith("## ") else text
        out += f"\n#### {body}\n\n{p.where()}.\n"
    return out


def errors_md(p: Pass) -> str:
    errs = p.of("error")
    if not errs:
        return ""
    return ("#### Errors\n\n" + table(("Stage", "Error", "Where"), [(r.get("stage"), r.get("error"), r.get("where"))
                                                                   for r in errs]) + "\n")


def render(records: List[Record], doc: str) -> str:
    """The block that goes between the markers of ``doc`` (GPU_RESULTS or LOW_MEMORY)."""
    p = Pass(records)
    if doc == "LOW_MEMORY":
        parts = [header(p, doc), memory_md(p),
                 tests_md(p, only=("24gb", "block_swap", "offload", "fused_adamw"))]
    else:
        parts = [header(p, doc), stages_md(p), tests_md(p), steps_md(p), memory_md(p), attention_md(p), int8_md(p),
                 startup_md(p), markdown_md(p), errors_md(p)]
    return "\n".join(part for part in parts if part).rstrip() + "\n"


def apply(doc_path: Path, block: str) -> None:
    """Replace what is between the markers (or put the block, with markers, after the title)."""
    text = doc_path.read_text(encoding="utf-8")
    wrapped = f"{BEGIN}\n{block.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        text = before + wrapped + rest.split(END, 1)[1]
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{wrapped}\n{rest}"
    tmp = doc_path.with_name(doc_path.name + ".tmp")  # then a rename: a crash mid-write keeps the old doc whole
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, doc_path)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the pass's results.jsonl")
    parser.add_argument("--apply", action="store_true", help="write the blocks into docs/GPU_RESULTS.md and LOW_MEMORY.md")
    parser.add_argument("--summary", action="store_true", help="print the pass's summary table")
    args = parser.parse_args(argv)
    records = read_records(args.results)
    if not records:
        raise SystemExit(f"{args.results}: no records (is it a GPU pass's results.jsonl?)")
    if args.summary:
        print(summary(records))
        return
    for doc, path in DOCS.items():
        block = render(records, doc)
        if args.apply:
            apply(path, block)
            print(f"updated {path.relative_to(ROOT)}")
        else:
            print(f"<!-- {path.relative_to(ROOT)} -->\n{block}")


if __name__ == "__main__":
    main()
