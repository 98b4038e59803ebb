"""The README's first command, ``bash scripts/quickstart.sh``, end to end in a copy of the repository
(its tracked files) whose ``.venv`` is this interpreter's environment, so the set-up finds everything
installed: the tiny model and the sample data are built, a LoRA is trained and saved, and the two
samples it renders (the base model's and the LoRA's) are written and differ. Then the render command it
prints runs as printed. Every program is a fresh interpreter (bash starts them): none prints a known-harmless
third-party warning (tests/test_quiet.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from test_quiet import third_party_lines

pytestmark = pytest.mark.e2e


def test_quickstart_trains_saves_and_renders_both_samples(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if venv == Path(sys.base_prefix):
        pytest.skip("the quick-start runs in a virtual environment; this interpreter is not in one")
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    (repo / ".venv").symlink_to(venv)
    result = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=repo, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = repo / "output" / "quickstart"
    assert "quick-start done in" in result.stdout and (out / "pytorch_lora_weights.safetensors").is_file()
    base, lora = (np.asarray(Image.open(out / name), dtype=np.float64) for name in ("sample_base.png",
                                                                                    "sample_lora.png"))
    assert base.shape == lora.shape == (64, 64, 3)
    assert np.abs(lora - base).mean() > 0.5, "the LoRA's sample differs from the base model's"
    assert "Attention backend:" in result.stderr, "the run's own lines show"
    assert third_party_lines(result.stdout + result.stderr) == []
    (again,) = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("render again: ")]
    render = subprocess.run(["bash", "-c", f". .venv/bin/activate && {again}"], cwd=repo, capture_output=True,
                            text=True, timeout=300)
    assert render.returncode == 0, render.stdout[-2000:] + render.stderr[-3000:]
    assert (repo / "lora.png").is_file() and (repo / "base.png").is_file()
    assert third_party_lines(render.stdout + render.stderr) == []
