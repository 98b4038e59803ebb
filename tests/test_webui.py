"""The web page's JSON API with FastAPI's test client: run discovery from the files a run folder
holds (old and new), the paths it refuses, the CLI's config errors, the form's schema, the token, and
stopping a child through a stand-in launcher. The real page in a browser: tests/test_webui_browser.py."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Union

import pytest

pytest.importorskip("fastapi", reason="the web page needs fastapi (requirements.txt)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (requirements.txt)")
from fastapi.testclient import TestClient  # noqa: E402

from trainer import cli  # noqa: E402
from webui import launch  # noqa: E402
from webui.schema import schema_fields, yaml_values  # noqa: E402
from webui.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = (ROOT / "train_configs" / "quickstart_tiny.yaml").read_text()
SECRET = "TOP-SECRET-CONTENT"


def _metrics(folder: Path, lines: List[dict], torn: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + torn)


def _state_file(folder: Path, step: int) -> None:
    (folder / f"checkpoint-{step}").mkdir(parents=True)
    (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"step": step, "files": {}}))


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """Four runs as their folders hold them: an old stopped one (metrics with a torn last line and a
    checkpoint, nothing newer), a running one (run.lock of a live process, run_status.json, timed
    metrics with per-dataset losses), a finished one (summary.json, samples, LoRA) and a failed one."""
    base = tmp_path / "runs"
    old = base / "old"
    _metrics(old, [{"step": 1, "loss": 0.5, "lr": 1e-4}, {"step": 2, "loss": 0.4, "lr": 1e-4}], torn='{"step": 3, "lo')
    _state_file(old, 2)
    live = base / "live"
    _metrics(live, [{"step": s, "loss": 1.0, "lr": 1e-4, "time": 100.0 + 2 * s, "loss/faces": 0.9,
                     "loss/regularization": 1.1} for s in range(1, 11)])
    (live / "run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "started": 0}))
    (live / "run_status.json").write_text(json.dumps({"state": "running", "step": 10, "max_steps": 110,
                                                      "message": None, "time": 0}))
    (live / "config.yaml").write_text("family: qwen_image\npretrained_model_name_or_path: Qwen/Qwen-Image\n"
                                      "max_train_steps: 110\n")
    done = base / "done"
    _metrics(done, [{"step": 1, "loss": 0.3, "lr": 1e-4}])
    (done / "summary.json").write_text(json.dumps({"family": "flux", "peak_memory_gib": {"gpu_peak_allocated_gib": 3.5},
                                                   "outputs": {"weights": str(done / "pytorch_lora_weights.safetensors")}}))
    (done / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    (done / "samples" / "step-000000").mkdir(parents=True)
    (done / "samples" / "step-000000" / "prompt-0.png").write_bytes(b"png")
    (done / "samples" / "step-000001").mkdir(parents=True)
    (done / "samples" / "step-000001" / "prompt-0.png").write_bytes(b"png")
    (done / "train.log").write_text("".join(f"line {i}\n" for i in range(100)))
    failed = base / "failed"
    failed.mkdir()
    (failed / "run_status.json").write_text(json.dumps({"state": "failed", "step": 0, "message": "out of memory"}))
    (tmp_path / "secret.txt").write_text(SECRET)
    return base


@pytest.fixture
def client(runs_dir: Path) -> TestClient:
    return TestClient(create_app(runs_dir))


def test_runs_are_listed_with_their_state_and_progress(client: TestClient, runs_dir: Path) -> None:
    listed = {r["id"]: r for r in client.get("/api/runs").json()}
    assert {rid: r["state"] for rid, r in listed.items()} == {
        "old": "stopped", "live": "running", "done": "finished", "failed": "failed"}
    old, live, done = listed["old"], listed["live"], listed["done"]
    assert (old["step"], old["loss"], old["checkpoints"], old["s_per_step"]) == (2, 0.4, ["checkpoint-2"], None)
    assert (live["step"], live["max_steps"], live["family"], live["model"]) == (10, 110, "qwen_image", "Qwen/Qwen-Image")
    assert live["s_per_step"] == pytest.approx(2.0) and live["eta_s"] == pytest.approx(200.0)
    assert done["weights"] == "pytorch_lora_weights.safetensors"
    assert done["peak_memory_gib"] == {"gpu_peak_allocated_gib": 3.5}
    assert listed["failed"]["message"] == "out of memory"


def test_a_run_shows_metrics_samples_and_log_and_reads_only_new_lines(client: TestClient, runs_dir: Path) -> None:
    live = client.get("/api/runs/live").json()
    assert live["metrics"][0]["loss/faces"] == 0.9 and live["metrics_total"] == 10
    assert client.get("/api/runs/live?since=8").json()["metrics"] == live["metrics"][8:]
    done = client.get("/api/runs/done").json()
    assert done["samples"] == [{"step": 0, "files": ["samples/step-000000/prompt-0.png"]},
                               {"step": 1, "files": ["samples/step-000001/prompt-0.png"]}]
    assert done["log"].splitlines() == [f"line {i}" for i in range(60, 100)]
    # the torn line is left until it is complete
    assert [m["step"] for m in client.get("/api/runs/old").json()["metrics"]] == [1, 2]
    with open(runs_dir / "old" / "metrics.jsonl", "a") as fh:
        fh.write('ss": 0.35, "lr": 1e-4}\n')
    assert [m["loss"] for m in client.get("/api/runs/old").json()["metrics"]] == [0.5, 0.4, 0.35]


def test_files_of_a_run_are_served_and_the_lora_downloads(client: TestClient) -> None:
    assert client.get("/api/runs/done/files/samples/step-000001/prompt-0.png").content == b"png"
    lora = client.get("/api/runs/done/files/pytorch_lora_weights.safetensors")
    assert lora.content == b"weights" and "attachment" in lora.headers["content-disposition"]


@pytest.mark.parametrize("url", [
    "/api/runs/done/files/../../secret.txt", "/api/runs/done/files/..%2F..%2Fsecret.txt",
    "/api/runs/done/files/%2Fetc%2Fpasswd", "/api/runs/done/files//etc/passwd",
    "/api/runs/..%2Fsecret.txt", "/api/runs/..", "/api/runs/%2e%2e/files/secret.txt",
    "/api/runs/done/files/link-out", "/api/runs/linked-run", "/api/runs/linked-run/files/secret.txt",
    "/api/profiles/..%2FREADME.md", "/api/profiles/%2Fetc%2Fpasswd", "/api/profiles/link.yaml",
])
def test_no_path_outside_the_runs_folder_or_profiles_is_read(client: TestClient, runs_dir: Path, url: str) -> None:
    (runs_dir / "done" / "link-out").symlink_to(runs_dir.parent / "secret.txt")
    (runs_dir / "linked-run").symlink_to(runs_dir.parent, target_is_directory=True)
    profiles = runs_dir.parent / "profiles"
    profiles.mkdir()
    (profiles / "link.yaml").symlink_to(runs_dir.parent / "secret.txt")
    client = TestClient(create_app(runs_dir, profiles_dir=profiles))
    response = client.get(url)
    assert response.status_code == 404 and SECRET not in response.text, (url, response.text)
    assert "linked-run" not in [r["id"] for r in client.get("/api/runs").json()]


def test_profiles_are_listed_and_read(client: TestClient) -> None:
    assert "quickstart_tiny.yaml" in client.get("/api/profiles").json()
    assert client.get("/api/profiles/quickstart_tiny.yaml").json()["text"] == QUICKSTART


def test_config_errors_are_the_clis(client: TestClient, tmp_path: Path, sample_data: Path) -> None:
    bad = QUICKSTART + "learnin_rate: 1\n"
    response = client.post("/api/runs", json={"config": bad, "entry": "train.py", "overrides": ["max_train_steps=x"]})
    assert response.status_code == 422
    path = tmp_path / "config.yaml"
    path.write_text(bad)
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert cli.main("qwen_image", "t", ["--config", str(path), "max_train_steps=x"]) == 2
    assert response.json()["detail"]["message"] == stderr.getvalue().strip().replace(str(path), "config.yaml")
    assert "unknown key 'learnin_rate' (did you mean 'learning_rate'?)" in response.json()["detail"]["errors"]
    # value errors (after the keys are known) and the form's edits, typed by the schema
    # (the data folder exists, so that only the two edited keys are wrong, also on a fresh clone)
    form = {"rank": "0", "lr_scheduler": "no", "data_config.img_dir": str(sample_data)}
    errors = client.post("/api/runs", json={"config": QUICKSTART, "form": form}).json()
    # (the form's edits reach the config as overrides, and the CLI's message says so)
    assert errors["detail"]["errors"] == ["key 'lr_scheduler': value 'no' is not one of constant, constant_with_warmup, "
                                          "linear, cosine, cosine_with_restarts, polynomial (given as an override)",
                                          "key 'rank': value 0 must be >= 1 (given as an override)"]
    for body in ({"config": "a: [", "entry": "train.py"}, {"config": QUICKSTART, "entry": "rm.py"},
                 {"config": QUICKSTART, "overrides": ["--plan=1"]}, {"config": "- a list"}):
        assert client.post("/api/runs", json=body).status_code == 422, body
    assert client.get("/api/runs").json() and not (tmp_path / "runs" / "quickstart").exists()


@dataclass
class FutureValidation:
    """``validation.prompts`` as it will become: a string or a mapping per entry."""

    prompts: List[Union[str, Dict[str, object]]] = field(default_factory=list)


@dataclass
class FutureConfig:
    validation: FutureValidation = field(default_factory=FutureValidation)


def test_the_form_comes_from_the_schema_and_takes_any_field_type() -> None:
    fields = {f["key"]: f for f in schema_fields()}
    assert fields["lr_scheduler"]["kind"] == "choice" and "cosine" in fields["lr_scheduler"]["choices"]
    assert (fields["data_config.img_size"]["kind"], fields["data_config.img_size"]["default"]) == ("integer", "1024")
    assert fields["seed"]["optional"] and fields["validation.prompts"]["kind"] == "yaml"
    assert schema_fields(FutureConfig) == [{"key": "validation.prompts", "kind": "yaml", "optional": False, "choices": None,
                                      "default": "[]", "help": "", "section": "validation"}]
    text = "validation:\n  prompts: [a cat, {prompt: a dog, width: 64}]\n"
    assert json.loads(yaml_values(text)["validation.prompts"]) == ["a cat", {"prompt": "a dog", "width": 64}]
    assert launch.form_overrides({"validation.prompts": '["a: b"]', "output_dir": "x: y", "seed": ""},
                                 {"validation.prompts": "yaml", "output_dir": "text", "seed": "integer"}) == [
        'validation.prompts=["a: b"]', 'output_dir="x: y"', "seed=null"]


def test_entry_scripts_are_read_with_their_policy() -> None:
    import importlib

    found = launch.entries()
    assert {"train.py", "train_4090.py", "train_flux_lora.py"} <= set(found)
    assert found["train_4090.py"].defaults == importlib.import_module("train_4090").LOW_MEMORY
    assert (found["train_flux_lora.py"].family, found["train.py"].defaults) == ("flux", {})


def test_a_token_is_required_when_set(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delenv("WEBUI_TOKEN", raising=False)
    client = TestClient(create_app(runs_dir, token="s3cret"))
    assert client.get("/api/runs").status_code == 401
    assert client.get("/api/runs", headers={"X-Token": "wrong"}).status_code == 401
    assert client.get("/api/runs", headers={"X-Token": "s3cret"}).status_code == 200
    assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/?token=s3cret").status_code == 200  # sets the cookie the page's requests carry
    assert client.get("/api/runs/done/files/samples/step-000000/prompt-0.png").status_code == 200
    spec = importlib.util.spec_from_file_location("webui_script", ROOT / "webui.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--host", "0.0.0.0"]) == 2  # reachable from other machines: refused without a token


def test_a_localhost_server_refuses_other_host_names(runs_dir: Path) -> None:
    client = TestClient(create_app(runs_dir, allowed_hosts=["127.0.0.1", "localhost"]), base_url="http://localhost")
    assert client.get("/api/runs").status_code == 200
    assert client.get("/api/runs", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding


def test_start_stop_and_resume_through_a_launcher(runs_dir: Path, sample_data: Path) -> None:
    """The launch path with a stand-in for accelerate (tests/webui_fake_launcher.py): argument list,
    unique run folder, one run per folder, SIGTERM to the trainer only, stopped with a checkpoint, resume."""
    fake = launch.Launcher(command=[sys.executable, str(ROOT / "tests" / "webui_fake_launcher.py")])
    client = TestClient(create_app(runs_dir, launcher=fake))
    (runs_dir / "quickstart").mkdir()  # a folder already there: the new run takes the next name
    form = {"data_config.img_dir": str(sample_data),
            "overwrite_output_dir": "false"}
    run_id = client.post("/api/runs", json={"config": QUICKSTART, "form": form}).json()["id"]
    assert run_id == "quickstart-2"
    record = json.loads((runs_dir / run_id / "webui_launch.json").read_text())
    assert record["argv"][:2] == fake.command and record["argv"][-1] == f"output_dir={runs_dir / run_id}"
    assert (runs_dir / run_id / "webui_config.yaml").read_text() == QUICKSTART
    deadline = time.monotonic() + 30
    while client.get(f"/api/runs/{run_id}").json()["step"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.get(f"/api/runs/{run_id}").json()["state"] == "running"
    again = client.post("/api/runs", json={"config": QUICKSTART, "form": {**form, "overwrite_output_dir": "true"},
                                          "name": run_id})
    assert again.status_code == 409  # one run per output folder
    signalled = client.post(f"/api/runs/{run_id}/stop").json()["signalled"]
    assert signalled and fake.children[run_id].pid not in signalled  # the trainer, not the launcher
    assert client.post(f"/api/runs/{run_id}/stop").status_code == 409  # never a second signal (exit without saving)
    while client.get(f"/api/runs/{run_id}").json()["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    view = client.get(f"/api/runs/{run_id}").json()
    assert view["state"] == "stopped" and view["checkpoints"] and client.post(f"/api/runs/{run_id}/stop").status_code == 409
    assert client.post(f"/api/runs/{run_id}/resume").json() == {"id": run_id}
    assert fake.children[run_id].args[-2:] == ["resume_from_checkpoint=latest", f"output_dir={runs_dir / run_id}"]
    client.post(f"/api/runs/{run_id}/stop")
    fake.children[run_id].wait(timeout=30)
