"""The GPU pass (``benchmarks/gpu_pass.py``) on the CPU, so the one prepared device call keeps working:
a dry run of three stages end to end, the time budget and the stage limits with stand-in stages, the
parsing of pytest's output, and the docs' rows. Not marked ``gpu``: CI runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from benchmarks import gpu_pass, gpu_pass_docs

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device tool brings back from $OUT
PASS_ENV = {**os.environ, "PYTHON": sys.executable}  # gpu_pass.sh's stages run this interpreter (not PATH's python3)


def kinds(records: List[dict], kind: str) -> List[dict]:
    return [r for r in records if r["kind"] == kind]


def test_dry_run_of_two_stages_writes_results_docs_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(["bash", "benchmarks/gpu_pass.sh", "--dry-run", "--budget", "400", "--out", str(out),
                           "--stages", "qwen_step", "mem_16gb"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, env=PASS_ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(f.name for f in out.iterdir())
    assert all(f.is_file() for f in out.iterdir()) and len(files) <= 8 and all(NAME.match(f) for f in files), files
    records = gpu_pass.read_records(out / gpu_pass.RESULTS)
    stages = {r["stage"]: r for r in kinds(records, "stage")}
    assert [s for s in stages if s != "quanto_build"] == ["qwen_step", "mem_16gb"]
    assert all(stages[s]["status"] == "ok" and stages[s]["wall_s"] > 0 for s in ("qwen_step", "mem_16gb"))
    assert "gpu_pass_measure.py qwen_step" in stages["qwen_step"]["command"]
    assert "quanto_build" not in stages, "no selected stage needs quanto's kernels (auto_fit picks torchao): no build"
    start = kinds(records, "pass")[0]
    assert start["dry_run"] and start["commit"] and start["commit"] != "unknown"
    step = kinds(records, "step")[0]
    assert step["family"] == "qwen_image" and step["s_per_step"] > 0 and step["finite"] and len(step["losses"]) == 3
    assert step["variant"] == "today" and step["host_ms"] > 0 and step["hfu"] is None  # no peak known on a CPU
    assert len(step["host_times"]) == 3 and step["recompute_fraction"] == 1.0
    profile = kinds(records, "profile")[0]  # every step stage profiles one step
    assert profile["top"] and abs(sum(profile["shares"].values()) - 1) < 1e-3 and profile["unit"] == "CPU"
    assert profile["breakdown_ms"]["gemm"] > 0 and profile["breakdown_ms"]["lora"] > 0
    anatomy = kinds(records, "anatomy")
    assert [a["stage"] for a in anatomy] == ["qwen_step", "mem_16gb"] and anatomy[0]["gpu_busy_ms"] is None
    memory = kinds(records, "memory")[0]
    assert memory["profile"] == "16gb" and memory["blocks_to_swap"] == 1 and memory["finite"]
    docs = (out / gpu_pass.DOCS_OUT["GPU_RESULTS"]).read_text()
    assert "#### Step time, host and GPU time, MFU at 64^2" in docs and "##### Where the time goes: Qwen-Image" in docs
    assert "| Host ms | GPU busy ms | Bound |" in docs and "without the\n  final flush interval" in docs
    assert "| 16gb | `train_configs/train_lora_16gb.yaml` | 1 |" in (out / gpu_pass.DOCS_OUT["LOW_MEMORY"]).read_text()
    assert "Dry run on the CPU" in docs
    tail = done.stdout.strip().splitlines()
    assert tail[0].startswith("GPU pass (DRY RUN") and any(line.startswith("qwen_step          ok") for line in tail[-8:])


@pytest.mark.e2e
def test_dry_run_of_the_levers_preset(tmp_path: Path) -> None:
    """Issue 45's pass (``--preset levers``) end to end on tiny models: every stage ok, in order; each Qwen-Image
    lever is the step it names (no checkpointing; the whole model compiled; fp8 W8A8 blocks), each step explained
    by an anatomy record, and FLUX.1-dev's reproduction ran each variant in its own process."""
    out = tmp_path / "out"
    # gpu_pass.py itself, not its shell wrapper (whose settings the two-stage dry run above checks): its stages
    # then start from the suite's warmed interpreter (tests/zygote.py) instead of importing torch each
    done = subprocess.run([sys.executable, "benchmarks/gpu_pass.py", "--dry-run", "--preset", "levers", "--budget",
                           "1500", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1600,
                          env={**PASS_ENV, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = gpu_pass.read_records(out / gpu_pass.RESULTS)
    stages = [r for r in kinds(records, "stage") if r["stage"] != "quanto_build"]
    assert [s["stage"] for s in stages] == list(gpu_pass.PRESETS["levers"])
    assert all(s["status"] == "ok" for s in stages), [(s["stage"], s["status"]) for s in stages]
    steps = {r["stage"]: r for r in kinds(records, "step")}
    assert steps["qwen_step"]["checkpointing"] is True and steps["qwen_no_recompute"]["checkpointing"] is False
    whole = steps["qwen_whole_model"]
    assert whole["compiled"] and whole["compile_mode"] == "model_cudagraphs" and whole["finite"]
    assert "quantization.weights=float8_w8a8" in steps["qwen_fp8"]["settings"] and steps["qwen_fp8"]["finite"]
    assert steps["flux_compiled"]["compiled"] and steps["flux_compiled"]["finite"]
    assert {r["stage"] for r in kinds(records, "anatomy")} == set(steps) | {"mem_24gb", "mem_16gb"}
    repro = {r["variant"]: r for r in kinds(records, "repro")}
    assert list(repro) == ["compiled_ckpt", "compiled_no_ckpt", "compiled_ckpt_math", "eager_ckpt"]
    assert all(r["status"] == "ok" for r in repro.values()), repro
    docs = (out / gpu_pass.DOCS_OUT["GPU_RESULTS"]).read_text()
    assert "FLUX.1-dev compiled backward: the smallest reproduction" in docs and "| compiled_ckpt |" in docs


def test_machine_record_and_file(tmp_path: Path) -> None:
    from benchmarks import gpu_pass_measure

    gpu_pass_measure.machine(gpu_pass_measure.context("machine", tmp_path, dry_run=True))
    machine = kinds(gpu_pass.read_records(tmp_path / gpu_pass.RESULTS), "machine")[0]
    assert machine["versions"]["torch"] and machine["torch"] and machine["cpus"] >= 1
    text = (tmp_path / gpu_pass.MACHINE).read_text()
    assert "$ nvidia-smi" in text and "torch==" in text


@pytest.fixture
def fake_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A pass whose stages are stand-ins: ``python -c CODE`` per stage name."""
    scripts = {}

    def command(p, name, *extra):
        return [sys.executable, "-c", scripts[name]]

    monkeypatch.setattr(gpu_pass, "measure_command", command)
    out = tmp_path / "out"
    out.mkdir()
    p = gpu_pass.Pass(out, tmp_path / "work", budget_s=60.0, dry_run=True, t0=__import__("time").time())
    p.work.mkdir()
    p.log = open(out / gpu_pass.LOG, "a")
    yield p, scripts
    p.log.close()


def test_a_stage_past_its_limit_is_stopped_and_keeps_what_it_wrote(fake_pass) -> None:
    p, scripts = fake_pass
    record = ("import json,time;open({!r},'a').write(json.dumps({{'kind':'step','stage':'slow'}})+'\\n');"
              "print('RESULT step: written', flush=True);time.sleep(60)").format(str(p.results))
    scripts["slow"] = record
    gpu_pass.run_stage(p, gpu_pass.Stage("slow", 5, "slow", 1, 3, 1, 3))
    records = gpu_pass.read_records(p.results)
    assert kinds(records, "step") == [{"kind": "step", "stage": "slow"}], "the measurement before the limit is kept"
    stage = kinds(records, "stage")[-1]
    assert stage["status"].startswith("timed out after 3 s") and 3 <= stage["wall_s"] < 15
    assert "RESULT step: written" in (p.out / gpu_pass.LOG).read_text()


def test_a_stage_that_no_longer_fits_the_budget_is_skipped_and_the_next_one_runs(fake_pass) -> None:
    p, scripts = fake_pass
    scripts["small"] = "print('small ran')"
    p.budget_s = gpu_pass.END_RESERVE_S + 20  # 20 s left
    gpu_pass.run_stage(p, gpu_pass.Stage("big", 5, "big", 30, 60, 30, 60))
    gpu_pass.run_stage(p, gpu_pass.Stage("small", 5, "small", 2, 10, 2, 10))
    stages = kinds(gpu_pass.read_records(p.results), "stage")
    assert stages[0]["stage"] == "big" and stages[0]["status"].startswith("skipped: no time left")
    assert stages[1]["stage"] == "small" and stages[1]["status"] == "ok" and stages[1]["timeout_s"] <= 10


def test_a_quanto_stage_is_skipped_when_the_extension_failed_to_build(fake_pass) -> None:
    p, scripts = fake_pass
    p.quanto_status.write_text("failed: nvcc not found\n")
    gpu_pass.run_stage(p, gpu_pass.Stage("mem", 3, "mem", 1, 10, 1, 10, needs_quanto=True))
    stage = kinds(gpu_pass.read_records(p.results), "stage")[-1]
    assert stage["status"] == "skipped: quanto's CUDA extension did not build (failed: nvcc not found)"


def test_pytest_results_are_read_from_verbose_lines_when_junit_is_missing() -> None:
    text = "\n".join([
        "tests/gpu/test_gpu_quick.py::test_a PASSED                                  [ 12%]",
        "[gw1] [ 25%] FAILED tests/gpu/test_gpu_quick.py::test_b ",
        "[gw0] [ 37%] SKIPPED tests/test_train_e2e.py::test_c ",
        "tests/gpu/test_gpu_quick.py::test_d ",  # started, never finished (the stage was stopped)
        "FAILED tests/gpu/test_gpu_quick.py::test_b - AssertionError: losses differ",
    ])
    found = {t["id"]: t["outcome"] for t in gpu_pass.parse_verbose(text)}
    assert found == {"tests/gpu/test_gpu_quick.py::test_a": "passed", "tests/gpu/test_gpu_quick.py::test_b": "failed",
                     "tests/test_train_e2e.py::test_c": "skipped"}


def test_docs_rows_keep_a_missed_target_with_its_figure_and_the_profile(tmp_path: Path) -> None:
    records = [
        {"kind": "pass", "event": "start", "commit": "abc1234", "budget_s": 460, "dry_run": False, "when": "now"},
        {"kind": "machine", "gpu": "NVIDIA H200", "driver": "580", "torch": "2.11.0+cu130", "versions": {}},
        {"kind": "step", "stage": "qwen_step", "title": "Qwen-Image", "variant": "today", "compile": "auto",
         "compiled": True, "checkpointing": True, "compile_mode": "blocks", "s_per_step": 0.61, "first_step_s": 30.2,
         "mfu": 0.26, "hfu": 0.379, "host_ms": 590.0, "peak_gib": 40.1, "target_s": 0.45, "device": "NVIDIA H200",
         "resolution": 1024, "tflop_per_step": 154.9},
        {"kind": "anatomy", "stage": "qwen_step", "variant": "today", "gpu_busy_ms": 470.2, "bound": "host",
         "host_ms": 590.0, "mfu": 0.26, "hfu": 0.379,
         "breakdown_ms": {"gemm": 240.0, "attention": 105.0, "elementwise": 75.0, "lora": 28.0, "optimizer": 2.0,
                          "copy": 0.1}},
        {"kind": "profile", "stage": "qwen_step", "title": "Qwen-Image", "variant": "today", "s_per_step": 0.61,
         "unit": "device", "busy_ms": 470.2, "breakdown_ms": {"gemm": 240.0, "attention": 105.0},
         "shares": {"gemm": 0.51, "attention": 0.22},
         "top": [{"name": "nvjet_gemm", "calls": 10, "ms_per_step": 5.0, "share": 0.5, "category": "gemm"}]},
        {"kind": "memory", "stage": "mem_24gb", "profile": "24gb", "yaml": "train_configs/train_lora_4090.yaml",
         "budget_gib": 22, "device_peak_gib": 23.5, "within_budget": False, "s_per_step": 2.1, "device": "NVIDIA H200"},
        {"kind": "stage", "stage": "qwen_step", "status": "ok", "wall_s": 80},
        {"kind": "pass", "event": "end", "wall_s": 455},
    ]
    gpu = gpu_pass_docs.render(records, "GPU_RESULTS")
    assert ("| Qwen-Image | today | all blocks | blocks (compiled) | 0.610 | 590 | 470 | host | 240 | 105 | 75 | 28 | 2 | "
            "26.0% | 37.9% | 40.10 |") in gpu and "**misses** 0.45 (H100 target) by +36%" in gpu
    assert "| NVIDIA H200 | abc1234 |" in gpu and "this card is **NVIDIA H200**" in gpu
    assert "GPU busy 470.2 ms; gemm 240.0 ms, attention 105.0 ms" in gpu
    assert "| `nvjet_gemm` | 10 | 5.0 | 50.0% | gemm |" in gpu
    low = gpu_pass_docs.render(records, "LOW_MEMORY")
    assert "| 24gb | `train_configs/train_lora_4090.yaml` |" in low and "| 23.50 | 22 | **no** |" in low
    doc = tmp_path / "DOC.md"
    doc.write_text("# Title\n\nintro\n")
    gpu_pass_docs.apply(doc, "first")
    gpu_pass_docs.apply(doc, "second")
    text = doc.read_text()
    assert text.count(gpu_pass_docs.BEGIN) == 1 and "second" in text and "first" not in text and "intro" in text
    summary = gpu_pass_docs.summary(records)
    assert "qwen_step          ok" in summary and "today: host 590 ms, GPU busy 470 ms per step (host-bound)" in summary


def test_results_survive_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    gpu_pass.append_record(path, {"kind": "a", "x": float("nan")})
    with open(path, "a") as fh:
        fh.write('{"kind": "b", "tor')
    assert [r["kind"] for r in gpu_pass.read_records(path)] == ["a"]
    assert json.loads(path.read_text().splitlines()[0].replace("NaN", "null"))["x"] is None


def test_the_families_stage_runs_the_new_families_tests_in_one_process_and_counts_them_apart(tmp_path: Path) -> None:
    """The ``families`` stage's pytest selects the new families' GPU tests (not the quick subset), without
    xdist workers (two full-size models on one GPU would measure neither); the summary counts each tests
    stage's outcomes on its own line."""
    p = gpu_pass.Pass(tmp_path, tmp_path / "work", budget_s=60.0, dry_run=False, t0=0.0)
    stage = {s.name: s for s in gpu_pass.STAGES}
    families = gpu_pass.tests_command(p, stage["families"], 200)
    quick = gpu_pass.tests_command(p, stage["tests"], 120)
    assert families[-3:] == ["tests/gpu/test_gpu_suite.py", "-k", gpu_pass.FAMILY_TESTS[-1]] and "-n" not in families
    assert "qwen_image21" in families[-1] and set(gpu_pass.QUICK_TESTS) <= set(quick)
    records = [{"kind": "pass", "event": "start", "commit": "x", "budget_s": 60},
               {"kind": "stage", "stage": "tests", "status": "ok", "wall_s": 5},
               {"kind": "test", "stage": "tests", "id": "a", "outcome": "passed"},
               {"kind": "stage", "stage": "families", "status": "ok", "wall_s": 9},
               {"kind": "test", "stage": "families", "id": "b", "outcome": "passed"},
               {"kind": "test", "stage": "families", "id": "c", "outcome": "failed", "message": "boom"}]
    table = gpu_pass_docs.summary(records)
    lines = {line.split()[0]: line for line in table.splitlines()[2:] if line and not line.startswith(" ")}
    assert lines["tests"].endswith("1 passed") and lines["families"].endswith("1 failed, 1 passed"), table
    assert "test failed: c boom" in table
