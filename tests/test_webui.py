"""The web page's JSON API with FastAPI's test client: run discovery from the files a run folder
holds (old and new), the paths it refuses, the CLI's config errors, the form's schema, and every
refusal of issue 29 (other sites, the token, replacing a run, interpolation, paths outside the runs
folder, malformed values, huge bodies, name races), the states right after a start or a resume, the
queue, clone, delete, checkpoints and captions; runs go through a stand-in launcher
(tests/webui_fake_launcher.py). Ctrl-C and a restart are tested on the real ``webui.py``. The real
page in a browser: tests/test_webui_browser.py."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Union

import pytest

pytest.importorskip("fastapi", reason="the web page needs fastapi (requirements.txt)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (requirements.txt)")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from trainer import cli  # noqa: E402

from trainer.run_folder import run_lock
from utils.errors import ConfigError  # noqa: E402
from webui import rules, runner  # noqa: E402
from webui.guard import SESSION_COOKIE  # noqa: E402
from webui.schema import schema_fields, yaml_values  # noqa: E402
from webui.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = (ROOT / "train_configs" / "quickstart_tiny.yaml").read_text()
FAKE = ROOT / "tests" / "webui_fake_launcher.py"
SECRET = "TOP-SECRET-CONTENT"


def _metrics(folder: Path, lines: List[dict], torn: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + torn)


def _state_file(folder: Path, step: int) -> None:
    (folder / f"checkpoint-{step}").mkdir(parents=True)
    (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"step": step, "files": {}}))


def _wait(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


def _snapshot(folder: Path) -> Dict[str, str]:
    """Every file under ``folder`` with its content's hash."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def runs_dir(tmp_path: Path) -> Iterator[Path]:
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
    held = os.open(live / "run.lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live owner holds its lock (trainer/run_folder/run_lock.py)
    (live / "run_status.json").write_text(json.dumps({"state": "running", "step": 10, "max_steps": 110,
                                                      "message": None, "time": 0}))
    (live / "config.yaml").write_text("family: qwen_image\npretrained_model_name_or_path: Qwen/Qwen-Image\n"
                                      "max_train_steps: 110\n")
    done = base / "done"
    _metrics(done, [{"step": 1, "loss": 0.3, "lr": 1e-4}])
    (done / "summary.json").write_text(json.dumps({"family": "flux", "peak_memory_gib": {"gpu_peak_allocated_gib": 3.5},
                                                   "outputs": {"weights": str(done / "pytorch_lora_weights.safetensors")}}))
    (done / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    (done / "config.yaml").write_text("validation:\n  prompts: [a red square, {prompt: a blue circle, width: 64}]\n")
    for step in (0, 1):
        (done / "samples" / f"step-{step:06d}").mkdir(parents=True)
        for i in (0, 1):
            (done / "samples" / f"step-{step:06d}" / f"prompt-{i}.png").write_bytes(b"png")
    (done / "train.log").write_text("".join(f"line {i}\n" for i in range(100)))
    failed = base / "failed"
    failed.mkdir()
    (failed / "run_status.json").write_text(json.dumps({"state": "failed", "step": 0, "message": "out of memory"}))
    (tmp_path / "secret.txt").write_text(SECRET)
    yield base
    os.close(held)


@pytest.fixture
def client(runs_dir: Path) -> TestClient:
    return TestClient(create_app(runs_dir))


@pytest.fixture
def fake_app(runs_dir: Path) -> Iterator[Callable[..., Any]]:
    """``fake_app(**create_app options)``: an app whose runs are the stand-in launcher's; every child
    it started is killed at the end."""
    made: List[Any] = []

    def make(**options: Any) -> Any:
        app = create_app(options.pop("runs", runs_dir), launcher=runner.Launcher(command=[sys.executable, str(FAKE)]),
                         **options)
        made.append(app)
        return app

    yield make
    for app in made:
        app.state.page.launcher.on_exit = lambda *args: None  # no queued run starts while they go
    for app in made:
        for child in list(app.state.page.launcher.children.values()):
            if child.poll() is None:
                child.terminate()  # passed on to the "trainer", which exits (SIGKILL would leave it orphaned)
                child.wait(timeout=30)


def _form(sample_data: Path, **edits: str) -> Dict[str, str]:
    return {"data_config.img_dir": str(sample_data), **edits}


def _view(client: TestClient, run_id: str) -> Dict[str, Any]:
    return client.get(f"/api/runs/{run_id}").json()


# -- what the page shows ---------------------------------------------------------------------------

def test_runs_are_listed_with_their_state_and_progress(client: TestClient, runs_dir: Path) -> None:
    listed = {r["id"]: r for r in client.get("/api/runs").json()}
    assert {rid: r["state"] for rid, r in listed.items()} == {
        "old": "stopped", "live": "running", "done": "finished", "failed": "failed"}
    old, live, done = listed["old"], listed["live"], listed["done"]
    assert (old["step"], old["loss"], old["checkpoints"], old["s_per_step"]) == (2, 0.4, ["checkpoint-2"], None)
    assert (live["step"], live["max_steps"], live["family"], live["model"]) == (10, 110, "qwen_image", "Qwen/Qwen-Image")
    assert live["s_per_step"] == pytest.approx(2.0) and live["eta_s"] == pytest.approx(200.0)
    assert live["started"] == 102.0 and live["duration_s"] == pytest.approx(time.time() - 102.0, abs=5)
    assert done["weights"] == "pytorch_lora_weights.safetensors" and done["samples_count"] == 4
    assert done["peak_memory_gib"] == {"gpu_peak_allocated_gib": 3.5}
    assert listed["failed"]["message"] == "out of memory"


def test_a_run_shows_metrics_samples_with_prompts_and_log(client: TestClient, runs_dir: Path) -> None:
    live = client.get("/api/runs/live").json()
    assert live["metrics"][0]["loss/faces"] == 0.9 and live["metrics_total"] == 10
    assert client.get("/api/runs/live?since=8").json()["metrics"] == live["metrics"][8:]
    done = client.get("/api/runs/done").json()
    assert done["samples"] == [
        {"step": step, "files": [f"samples/step-{step:06d}/prompt-{i}.png" for i in (0, 1)],
         "prompts": ["a red square", "a blue circle"]} for step in (0, 1)]
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
    "/api/runs/done/checkpoints/..%2F..%2Fsecret.txt.zip", "/api/runs/done/dataset/0/images/..%2F..%2Fsecret.txt",
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


@dataclass
class FutureValidation:
    """``validation.prompts`` as it will become: a string or a mapping per entry."""

    prompts: List[Union[str, Dict[str, object]]] = field(default_factory=list)


@dataclass
class FutureConfig:
    validation: FutureValidation = field(default_factory=FutureValidation)


def test_the_form_comes_from_the_schema_with_help_and_the_common_keys_first() -> None:
    fields = {f["key"]: f for f in schema_fields()}
    assert fields["lr_scheduler"]["kind"] == "choice" and "cosine" in fields["lr_scheduler"]["choices"]
    assert (fields["data_config.img_size"]["kind"], fields["data_config.img_size"]["default"]) == ("integer", "1024")
    assert fields["seed"]["optional"] and fields["validation.prompts"]["kind"] == "yaml"
    common = sorted((f for f in fields.values() if f["common"]), key=lambda f: f["order"])
    assert [f["key"] for f in common] == [
        "pretrained_model_name_or_path", "data_config.img_dir", "data_config.trigger_word", "max_train_steps",
        "learning_rate", "rank", "data_config.img_size", "validation.prompts", "validation.every_n_steps",
        "checkpointing_steps"]
    assert all(f["help"] and "\n" not in f["help"] for f in common), [f["key"] for f in common if not f["help"]]
    # help from the schema: metadata, the comment beside a field, a comment block above it, a base class's
    assert fields["lr_scheduler"]["help"] == "diffusers' get_scheduler"
    assert fields["lora_alpha"]["help"] == "default: rank (scale 1.0)"
    assert fields["validation.prompts"]["help"].startswith("Each a string or a mapping of ValidationPrompt's keys")
    assert fields["data_config.img_size"]["help"] == "longest side after resize, as in FlyMyAI"
    assert fields["output_dir"]["help"] == ""  # a group's heading comment ("# Output and logging") is no key's help
    assert schema_fields(FutureConfig) == [{"key": "validation.prompts", "kind": "yaml", "optional": False, "choices": None,
                                            "default": "[]", "help": "", "section": "validation", "common": True,
                                            "label": "sample prompts", "order": 7}]
    text = "validation:\n  prompts: [a cat, {prompt: a dog, width: 64}]\n"
    assert json.loads(yaml_values(text)["validation.prompts"]) == ["a cat", {"prompt": "a dog", "width": 64}]
    assert runner.form_overrides({"validation.prompts": '["a: b"]', "output_dir": "x: y", "seed": ""},
                                 {"validation.prompts": "yaml", "output_dir": "text", "seed": "integer"}) == [
        'validation.prompts=["a: b"]', 'output_dir="x: y"', "seed=null"]


def test_entry_scripts_are_read_with_their_policy() -> None:
    import importlib

    found = runner.entries()
    assert {"train.py", "train_4090.py", "train_flux_lora.py"} <= set(found)
    assert found["train_4090.py"].defaults == importlib.import_module("train_4090").LOW_MEMORY
    assert (found["train_flux_lora.py"].family, found["train.py"].defaults) == ("flux", {})


# -- bad input: the CLI's messages, 4xx, never a 500 or an echo ------------------------------------

@pytest.mark.parametrize("override, precision", [([], "no"), (["mixed_precision=bf16"], "bf16")])
def test_a_cpu_run_is_launched_as_the_quick_start_launches_it(runs_dir: Path, sample_data: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture, override: List[str],
                                                              precision: str) -> None:
    """Case 40: without a GPU the page's launcher line is the quick-start's (one CPU thread, the
    config's mixed precision), so accelerate fills in no default, and says so in no warning."""
    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = runs_dir / "cpu"
    folder.mkdir()
    (folder / "webui_config.yaml").write_text(QUICKSTART)
    overrides = [f"data_config.img_dir={sample_data}", *override]
    argv = runner.Launcher().argv(folder, runner.entry_named("train.py"), overrides)
    launcher_args = argv[argv.index("trainer.launch") + 1: argv.index(str(ROOT / "train.py"))]
    assert launcher_args == ["--cpu", "--num_cpu_threads_per_process", "1", "--num_processes", "1", "--num_machines",
                             "1", "--dynamo_backend", "no", "--mixed_precision", precision]
    with caplog.at_level("WARNING", logger="accelerate.commands.launch"):
        _validate_launch_command(launch_command_parser().parse_args([*launcher_args, "train.py"]))
    assert "had defaults used instead" not in caplog.text, caplog.text


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
                 {"config": QUICKSTART, "overrides": ["--plan=1"]}, {"config": "- a list"},
                 {"config": QUICKSTART, "name": "x" * 129}, {"config": QUICKSTART, "name": "../up"},
                 {"config": QUICKSTART, "gpu_memory": "--help"}, {"config": 5}, {"form": {}}):
        assert client.post("/api/runs", json=body).status_code == 422, body
    assert client.post("/api/runs", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    assert not (runs_dir := tmp_path / "runs" / "quickstart").exists(), runs_dir


def test_the_entry_script_follows_the_models_family(client: TestClient, tmp_path: Path, sample_data: Path) -> None:
    """Case 39: the form learns a YAML's family (its ``family:``, else its model's pipeline) to pick the
    entry script; a start whose model is another family's checkpoint is refused at once, in one line."""
    flux = tmp_path / "some-flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    config = QUICKSTART.replace("pretrained_model_name_or_path: ", f"pretrained_model_name_or_path: {flux}  # ")
    assert client.post("/api/form", json={"config": config}).json()["family"] == "flux"
    assert client.post("/api/form", json={"config": "family: krea2\n"}).json()["family"] == "krea2"
    nothing = f"pretrained_model_name_or_path: {tmp_path / 'nothing'}\n"
    assert client.post("/api/form", json={"config": nothing}).json()["family"] is None  # nothing says
    refused = client.post("/api/runs", json={"config": config, "entry": "train.py", "name": "mixed",
                                             "form": _form(sample_data)})
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]["errors"]
    assert "is a FluxPipeline checkpoint" in error and "train it with train_flux_lora.py" in error
    assert not (client.app.state.page.runs_dir / "mixed").exists()


def test_a_malformed_value_in_any_field_or_override_is_a_422(client: TestClient, runs_dir: Path, sample_data: Path) -> None:
    """Every key of the schema, as a form field and as an override, with YAML that does not parse:
    the CLI's one-line message naming the key, never a 500. (Text fields of the form are sent
    quoted: any text is a valid string there.)"""
    before = _snapshot(runs_dir)
    for f in schema_fields():
        for bad in ("[to_q, to_k", "{"):
            bodies = [{"config": QUICKSTART, "overrides": [f"{f['key']}={bad}"], "form": _form(sample_data)}]
            if f["kind"] != "text":
                bodies.append({"config": QUICKSTART, "form": _form(sample_data, **{f["key"]: bad})})
            for body in bodies:
                for url in ("/api/runs", "/api/plan"):
                    response = client.post(url, json=body)
                    assert response.status_code == 422, (url, body, response.text)
                    message = response.json()["detail"]["message"]
                    named = (f"override '{f['key']}=", f"key '{f['key']}'")  # a choice is sent quoted: not one of
                    assert any(n in message for n in named) and "\n" not in message, message
    assert client.post("/api/form", json={"config": "a: [to_q, to_k"}).status_code == 422
    assert _snapshot(runs_dir) == before


@pytest.mark.parametrize("what", ["config", "override", "junk", "chunked"])
def test_a_10_mb_body_is_refused_without_echoing_it(client: TestClient, runs_dir: Path, what: str) -> None:
    big = "x" * (10 * 2**20)
    if what == "chunked":  # no Content-Length: counted as it arrives
        body = json.dumps({"config": big}).encode()
        response = client.post("/api/runs", content=(body[i:i + 2**20] for i in range(0, len(body), 2**20)),
                               headers={"content-type": "application/json"})
    else:
        content = {"config": json.dumps({"config": big}), "override": json.dumps({"config": "", "overrides": [f"a={big}"]}),
                   "junk": "{" * len(big)}[what].encode()
        response = client.post("/api/runs", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 413 and len(response.content) < 300, response.content[:300]
    assert "x" * 100 not in response.text
    assert client.post("/api/runs", json={"config": "x" * 1_000_001}).text.count("x") < 100  # under the limit: 422, no echo


# -- other sites and the token ---------------------------------------------------------------------

CHANGES = [("POST", "/api/runs", {"config": QUICKSTART}), ("POST", "/api/plan", {"config": QUICKSTART}),
           ("POST", "/api/runs/live/stop", None), ("POST", "/api/runs/old/resume", None),
           ("POST", "/api/runs/old/cancel", None), ("DELETE", "/api/runs/done", None),
           ("POST", "/api/runs/done/dataset/0/captions", {"image": "a.png", "caption": "x"}),
           ("POST", "/api/form", {"config": "a: 1"})]
FOREIGN = [{"Origin": "http://evil.example"}, {"Origin": "null"}, {"Origin": "http://testserver:8080"},
           {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
           {"Referer": "http://evil.example/page.html"},
           {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},  # a plain <form>
           {"Origin": "http://evil.example", "Content-Type": "text/plain"}]  # fetch(no-cors) with a JSON blob


@pytest.mark.parametrize("method, url, body", CHANGES)
def test_no_other_site_can_change_anything(client: TestClient, runs_dir: Path, method: str, url: str, body: Any) -> None:
    before = _snapshot(runs_dir)
    for headers in FOREIGN:
        content = json.dumps(body).encode() if body is not None else b""
        response = client.request(method, url, content=content, headers={"Content-Type": "application/json", **headers})
        assert response.status_code == 403, (headers, response.status_code, response.text)
        assert "access-control-allow-origin" not in response.headers
    assert _snapshot(runs_dir) == before
    # the page itself (same origin) and tools without a browser are let through
    assert client.request("DELETE", "/api/runs/failed", headers={"Origin": "http://testserver",
                                                                 "Sec-Fetch-Site": "same-origin"}).status_code == 200
    assert client.request("DELETE", "/api/runs/old").status_code == 200
    assert not (runs_dir / "failed").exists() and not (runs_dir / "old").exists()
    preflight = client.options("/api/runs", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_the_token_is_swapped_once_for_a_cookie(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    token = "s3cret-token-value"
    monkeypatch.delenv("WEBUI_TOKEN", raising=False)
    client = TestClient(create_app(runs_dir, token=token), follow_redirects=False)
    assert client.get("/api/runs").status_code == 401
    assert client.get("/api/runs", headers={"X-Token": "wrong"}).status_code == 401
    assert client.get("/api/runs", headers={"X-Token": token}).status_code == 200
    assert client.get("/api/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/?token=wrong").status_code == 401
    assert client.post(f"/api/runs/old/cancel?token={token}").status_code == 401  # exchanged on a GET only
    swapped = client.get(f"/?token={token}#/run/done")
    assert swapped.status_code == 303 and swapped.headers["location"] == "/"  # out of the address bar
    cookie = swapped.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token not in cookie
    assert client.get(f"/api/runs/done?token={token}&since=1").headers["location"] == "/api/runs/done?since=1"
    assert client.cookies.get(SESSION_COOKIE)  # the page's own requests (images, events) carry it
    assert client.get("/api/runs/done/files/samples/step-000000/prompt-0.png").status_code == 200
    assert client.get("/").status_code == 200 and token not in client.get("/").text
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, "forged")
    assert client.get("/api/runs").status_code == 401
    spec = importlib.util.spec_from_file_location("webui_script", ROOT / "webui.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--host", "0.0.0.0"]) == 2  # reachable from other machines: refused without a token


def test_children_get_no_page_secret(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A run and ``--plan`` get the server's environment without WEBUI_TOKEN (a config could write an
    environment value into files the page serves); captioning: tests/test_webui_captioning.py."""
    monkeypatch.setenv("WEBUI_TOKEN", "the-page-secret")
    client = TestClient(fake_app())
    client.post("/api/runs", json={"config": QUICKSTART, "name": "envy",
                                   "form": _form(sample_data, max_train_steps="2")})
    env_file = runs_dir / "envy" / "fake_env.json"
    env = json.loads(_wait(lambda: env_file.is_file() and env_file.read_text(), 30, "the run started"))
    assert env["WEBUI_TOKEN"] is None and env["HOME"] == os.environ["HOME"]  # the rest is passed on
    script = tmp_path / "print_env.py"
    script.write_text("import os; print(os.environ.get('WEBUI_TOKEN'), os.environ.get('HOME'))")
    planned = runner.plan("{}", runner.Entry(str(script), "qwen_image", {}, ""), [])  # --plan's child, as started
    assert planned["output"].split() == ["None", os.environ["HOME"]], planned


def test_a_recorded_child_is_alive_only_while_it_runs() -> None:
    """A record's pid counts while that process runs: not once it has ended and waits unreaped (an
    orphan's zombie, until a container's init reaps it), nor when the pid is another process's."""
    import psutil

    from webui.children import recorded_alive

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={**os.environ, "ZYGOTE": "0"})  # this process's own child (tests/zygote.py)
    record = {"pid": child.pid, "started": psutil.Process(child.pid).create_time()}
    assert recorded_alive(record)
    assert not recorded_alive({**record, "started": record["started"] - 60})  # the pid, reused by another process
    child.stdin.close()  # it ends, and is not waited for: a zombie
    _wait(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "a zombie")
    assert not recorded_alive(record)
    child.wait()


def test_a_localhost_server_refuses_other_host_names(runs_dir: Path) -> None:
    client = TestClient(create_app(runs_dir, allowed_hosts=["127.0.0.1", "localhost"]), base_url="http://localhost")
    assert client.get("/api/runs").status_code == 200
    assert client.get("/api/runs", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding


# -- configs are data, and write under the runs folder ---------------------------------------------

def test_no_interpolation_reaches_a_config(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEBUI_TEST_SECRET", SECRET)
    client = TestClient(fake_app())
    before = _snapshot(runs_dir)
    secret = "${oc.env:WEBUI_TEST_SECRET}"
    for body in ({"config": QUICKSTART + f"wandb_run_name: {secret}\n", "form": _form(sample_data)},
                 {"config": QUICKSTART + f"validation:\n  prompts: [a cat, '{secret}']\n", "form": _form(sample_data)},
                 {"config": QUICKSTART, "form": _form(sample_data, wandb_run_name=secret)},
                 {"config": QUICKSTART, "form": _form(sample_data), "overrides": [f"tracker_project_name={secret}"]},
                 {"config": QUICKSTART + "wandb_run_name: ${max_train_steps}\n", "form": _form(sample_data)},
                 {"config": QUICKSTART + f"'{secret}': 1\n", "form": _form(sample_data)}):
        for url in ("/api/runs", "/api/plan"):
            response = client.post(url, json=body)
            assert response.status_code == 422, (body, response.text)
            assert "is an interpolation" in response.json()["detail"]["message"] and SECRET not in response.text
    assert _snapshot(runs_dir) == before
    # a run's YAML edited by hand afterwards is refused on resume too
    (runs_dir / "old" / "webui_config.yaml").write_text(QUICKSTART + f"wandb_run_name: {secret}\n")
    assert "is an interpolation" in client.post("/api/runs/old/resume").json()["detail"]["message"]
    assert not any(SECRET in p.read_text(errors="replace") for p in runs_dir.rglob("*") if p.is_file())


# The review's spellings that once got past the page's check of the text (webui-2d769dd.md, cases 8, 10):
# YAML's \x24 / \u0024 escapes, a resolver name built from a key, an escaped backslash before ${.
ESCAPED = "\\x24{oc.\\x24{tracker_project_name}:WEBUI_TEST_SECRET}"


@pytest.mark.parametrize("how", ["yaml", "form", "override", "u0024", "backslash"])
def test_no_spelling_of_an_interpolation_gets_past_the_page(fake_app: Callable[..., Any], runs_dir: Path,
                                                            sample_data: Path, monkeypatch: pytest.MonkeyPatch,
                                                            how: str) -> None:
    monkeypatch.setenv("WEBUI_TEST_SECRET", SECRET)
    client = TestClient(fake_app())
    before = _snapshot(runs_dir)
    body = {
        "yaml": {"config": QUICKSTART + f'tracker_project_name: env\nwandb_run_name: "{ESCAPED}"\n',
                 "form": _form(sample_data)},
        "form": {"config": QUICKSTART, "form": _form(sample_data, tracker_project_name="env",
                                                     **{"validation.prompts": f'["{ESCAPED}"]'})},
        "override": {"config": QUICKSTART + "tracker_project_name: env\n", "form": _form(sample_data),
                     "overrides": [f'wandb_run_name="{ESCAPED}"']},
        "u0024": {"config": QUICKSTART + 'wandb_run_name: "\\u0024{oc.env:WEBUI_TEST_SECRET}"\n',
                  "form": _form(sample_data)},
        "backslash": {"config": QUICKSTART + "wandb_run_name: '\\\\${oc.env:WEBUI_TEST_SECRET}'\n",
                      "form": _form(sample_data)},
    }[how]
    for url in ("/api/runs", "/api/plan"):
        response = client.post(url, json=body)
        assert response.status_code == 422, (url, response.text)
        assert "is an interpolation" in response.json()["detail"]["message"] and SECRET not in response.text
    assert _snapshot(runs_dir) == before


def test_a_cache_dir_is_checked_as_the_run_will_use_it(fake_app: Callable[..., Any], runs_dir: Path,
                                                       sample_data: Path, tmp_path: Path) -> None:
    """``output/${validation.negative_prompt}/${...}/../../outside`` looked like a path inside the runs
    folder to a check of the text; resolved, each ``${...}`` is empty and the ``..`` climb out."""
    client = TestClient(fake_app())
    ref = "\\x24{validation.negative_prompt}"
    inside = runs_dir.relative_to(ROOT) if runs_dir.is_relative_to(ROOT) else runs_dir
    cache = f"{inside}/{ref}/{ref}/../../outside/cache-escape-probe"
    for body in ({"config": QUICKSTART + f'cache_dir: "{cache}"\n', "form": _form(sample_data)},
                 {"config": QUICKSTART, "form": _form(sample_data), "overrides": [f'cache_dir="{cache}"']}):
        response = client.post("/api/runs", json=body)
        assert response.status_code == 422, response.text
    assert not (runs_dir.parent / "outside").exists() and not (ROOT / "outside").exists()
    # The page's rule on its own (beneath the refusal of interpolations): the resolved value is checked.
    resolved = rules.resolved(f'cache_dir: "{cache}"\n', [], "cache_dir")["cache_dir"]
    assert resolved == f"{inside}///../../outside/cache-escape-probe"
    with pytest.raises(ConfigError, match="key 'cache_dir'.* is outside"):
        rules.check_written_paths({"cache_dir": resolved}, ROOT, [runs_dir])


def test_every_folder_a_run_writes_is_under_the_runs_folder(fake_app: Callable[..., Any], runs_dir: Path, tmp_path: Path,
                                                            sample_data: Path) -> None:
    client = TestClient(fake_app())
    for cache_dir, why in (("/etc/webui-probe", "is outside"), ("cache", "is outside"),  # relative: the project's
                           (str(runs_dir / ".." / "elsewhere"), "is outside")):
        response = client.post("/api/runs", json={"config": QUICKSTART, "form": _form(sample_data, cache_dir=cache_dir)})
        assert response.status_code == 422 and why in response.json()["detail"]["errors"][0], response.text
        assert "--cache-root" in response.json()["detail"]["errors"][0]
    response = client.post("/api/runs", json={"config": QUICKSTART, "form": _form(sample_data, logging_dir="../../logs")})
    assert "key 'logging_dir'" in response.json()["detail"]["message"]
    assert not Path("/etc/webui-probe").exists()
    # output_dir names the run, never where it goes; a cache inside the runs folder, or the cache root, is fine
    started = client.post("/api/runs", json={"config": QUICKSTART, "form": _form(
        sample_data, output_dir="/etc", cache_dir=str(runs_dir / "shared-cache"), max_train_steps="3")}).json()
    assert started["id"] == "etc"
    argv = json.loads((runs_dir / "etc" / "webui_launch.json").read_text())["argv"]
    assert argv[-2:] == [f'output_dir="{runs_dir / "etc"}"', "overwrite_output_dir=false"]
    shared = tmp_path / "shared"
    client = TestClient(fake_app(cache_root=shared))
    assert client.post("/api/runs", json={"config": QUICKSTART, "form": _form(
        sample_data, cache_dir=str(shared / "qwen"), max_train_steps="3")}).status_code == 200
    odd = tmp_path / "my runs: #1"  # a runs folder whose name YAML would misread unquoted
    odd.mkdir()
    client = TestClient(fake_app(runs=odd))
    client.post("/api/runs", json={"config": QUICKSTART, "name": "r", "form": _form(sample_data, max_train_steps="3")})
    _wait(lambda: _view(client, "r")["state"] == "finished", 30, "the run finished in its folder")
    assert (odd / "r" / "checkpoint-3").is_dir()


# -- never replacing a run unasked; names are taken atomically ----------------------------------------

def test_a_run_is_replaced_only_when_asked_by_name(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path) -> None:
    client = TestClient(fake_app(max_concurrent=4))
    quick = runs_dir / "quickstart"  # the run scripts/quickstart.sh made: the profile says overwrite_output_dir: true
    _metrics(quick, [{"step": 40, "loss": 0.1, "lr": 1e-3}])
    for step in (40, 60):
        _state_file(quick, step)
    (quick / "pytorch_lora_weights.safetensors").write_bytes(b"the user's lora")
    (quick / "summary.json").write_text("{}")
    kept = _snapshot(quick)
    assert "overwrite_output_dir: true" in QUICKSTART
    body = {"config": QUICKSTART, "form": _form(sample_data, max_train_steps="2")}
    assert client.post("/api/runs", json=body).json()["id"] == "quickstart-2"  # no name: a new one
    assert client.post("/api/runs", json={**body, "replace": True}).json()["id"] == "quickstart-3"  # no name, no replace
    refused = client.post("/api/runs", json={**body, "name": "quickstart"})
    assert refused.status_code == 409 and refused.json()["detail"]["replaceable"] is True
    assert "replace it" in refused.json()["detail"]["errors"][0]
    assert _snapshot(quick) == kept
    # asked by name: the run there goes, the new one takes its place
    replaced = client.post("/api/runs", json={**body, "name": "quickstart", "replace": True})
    assert replaced.json() == {"id": "quickstart", "state": "starting"}
    assert not (quick / "checkpoint-60").exists() and not (quick / "pytorch_lora_weights.safetensors").exists()
    _wait(lambda: _view(client, "quickstart")["state"] == "finished", 30, "the new run finished")
    # a run that is running is never replaced
    long = client.post("/api/runs", json={**body, "form": _form(sample_data, max_train_steps="100000"),
                                          "name": "long"}).json()["id"]
    again = client.post("/api/runs", json={**body, "name": long, "replace": True})
    assert again.status_code == 409 and not again.json()["detail"]["replaceable"]
    assert client.post(f"/api/runs/{long}/stop").status_code == 200


def test_starts_with_one_name_are_atomic(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path) -> None:
    """Four requests for one name at once: one run, started with its own config; three 409s with
    nothing of theirs written."""
    with TestClient(fake_app(max_concurrent=4)) as client:
        answers: Dict[int, Any] = {}

        def start(steps: int) -> None:
            answers[steps] = client.post("/api/runs", json={"config": QUICKSTART, "name": "race",
                                                            "form": _form(sample_data, max_train_steps=str(steps))})

        threads = [threading.Thread(target=start, args=(steps,)) for steps in (41, 42, 43, 44)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in answers.values())
        assert codes == [200, 409, 409, 409], {s: r.text for s, r in answers.items()}
        winner = next(s for s, r in answers.items() if r.status_code == 200)
        record = json.loads((runs_dir / "race" / "webui_launch.json").read_text())
        assert f"max_train_steps={winner}" in record["overrides"] and record["max_steps"] == winner
        assert [a for a in record["argv"] if a.startswith("max_train_steps=")] == [f"max_train_steps={winner}"]
        _wait(lambda: _view(client, "race")["state"] == "finished", 30, "the winner finished")
        assert _view(client, "race")["step"] == winner
        assert sorted(p.name for p in runs_dir.iterdir() if p.name.startswith("race")) == ["race"]


# -- state, queue, resume ------------------------------------------------------------------------------

def test_state_is_right_at_once_after_start_and_resume(fake_app: Callable[..., Any], sample_data: Path,
                                                       tiny_qwen_image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STARTUP_S", "1.5")  # the trainer takes a while to load before it writes anything
    client = TestClient(fake_app())
    body = {"config": QUICKSTART, "name": "steady",
            "form": _form(sample_data, pretrained_model_name_or_path=str(tiny_qwen_image), max_train_steps="500")}
    plan = client.post("/api/plan", json=body).json()
    assert plan["returncode"] == 0 and "GPU peak" in plan["output"]
    assert client.post("/api/runs", json=body).json() == {"id": "steady", "state": "starting"}
    view = _view(client, "steady")  # the profile says 60 steps; the form 500
    assert (view["state"], view["step"], view["max_steps"]) == ("starting", 0, 500)
    assert not view["stopping"] and view["plan"] == plan
    _wait(lambda: _view(client, "steady")["state"] == "running", 30, "running once the trainer is up")
    _wait(lambda: _view(client, "steady")["step"] >= 3, 30, "training")
    assert client.post("/api/runs/steady/stop").status_code == 200
    after = _view(client, "steady")  # stopping, or already stopped when the trainer was that quick
    assert after["stopping"] or after["state"] == "stopped", after
    _wait(lambda: _view(client, "steady")["state"] == "stopped", 30, "stopped")
    stopped = _view(client, "steady")
    assert stopped["checkpoints"] and (Path(client.app.state.page.runs_dir) / "steady" / "run_status.json").is_file()
    # resumed with more steps: starting at once (run_status.json still says "stopped"), the new max, the same plan
    assert client.post("/api/runs/steady/resume", json={"max_train_steps": 900}).json() == {"id": "steady", "state": "starting"}
    view = _view(client, "steady")
    assert (view["state"], view["max_steps"], view["plan"]) == ("starting", 900, plan)
    assert client.post("/api/runs/steady/resume").status_code == 409  # not twice
    _wait(lambda: _view(client, "steady")["state"] == "running", 30, "running again")
    assert _view(client, "steady")["step"] >= stopped["step"]
    assert client.post("/api/runs/steady/stop").status_code == 200
    _wait(lambda: _view(client, "steady")["state"] == "stopped", 30, "stopped again")
    assert client.post("/api/runs/steady/resume", json={"max_train_steps": 1}).status_code == 422  # fewer steps


def test_a_stop_is_sent_once_unless_the_trainer_never_saw_it(client: TestClient, runs_dir: Path) -> None:
    """A second SIGTERM makes a trainer exit without its checkpoint: refused while the trainer that
    got the first is writing it. A trainer that took the lock after the stop (sent while the launcher
    had no trainer yet to pass it to) never saw it: that one gets it."""
    folder = runs_dir / "late"
    folder.mkdir()
    holds = "import fcntl, os, sys, time; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT), fcntl.LOCK_EX); time.sleep(60)"
    trainer = subprocess.Popen([sys.executable, "-c", holds, str(folder / "run.lock")])
    try:
        _wait(lambda: run_lock.is_held(folder / "run.lock"), 30, "the trainer holds its lock")
        (folder / "webui_launch.json").write_text(json.dumps({"stop_requested": True, "stopped": 1000.0}))
        lock = {"host": socket.gethostname(), "pid": trainer.pid, "started": 900.0}
        (folder / "run.lock").write_text(json.dumps(lock))
        assert client.post("/api/runs/late/stop").status_code == 409 and _view(client, "late")["stopping"]
        assert trainer.poll() is None
        (folder / "run.lock").write_text(json.dumps({**lock, "started": 1100.0}))
        assert not _view(client, "late")["stopping"]
        assert client.post("/api/runs/late/stop").json() == {"id": "late", "signalled": [trainer.pid]}
        assert trainer.wait(timeout=10) == -signal.SIGTERM
    finally:
        trainer.kill()


def test_a_finished_run_resumes_only_with_more_steps(fake_app: Callable[..., Any], sample_data: Path) -> None:
    client = TestClient(fake_app())
    body = {"config": QUICKSTART, "name": "short", "form": _form(sample_data, max_train_steps="5")}
    client.post("/api/runs", json=body)
    _wait(lambda: _view(client, "short")["state"] == "finished", 30, "finished")
    response = client.post("/api/runs/short/resume")
    assert response.status_code == 422 and "give more steps" in response.json()["detail"]["message"]
    assert client.post("/api/runs/short/resume", json={"max_train_steps": 12}).json()["state"] == "starting"
    _wait(lambda: _view(client, "short")["state"] == "finished", 30, "finished again")
    view = _view(client, "short")
    assert (view["step"], view["max_steps"], view["checkpoints"][-1]) == (12, 12, "checkpoint-12")


def test_a_resume_racing_a_delete_is_never_a_500(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 12: a DELETE arriving while a resume checks the run. The resume either wins (the delete is
    then refused: the run is active) or finds the run gone; never a 500."""
    client = TestClient(fake_app(), raise_server_exceptions=False)
    client.post("/api/runs", json={"config": QUICKSTART, "name": "racy",
                                   "form": _form(sample_data, max_train_steps="4", checkpointing_steps="2")})
    _wait(lambda: _view(client, "racy")["state"] == "finished", 30, "finished")
    from webui import api_runs

    deleted: Dict[str, Any] = {}
    real_check = api_runs.check_relaunch

    def check_while_deleting(*args: Any) -> Any:  # the DELETE comes in mid-resume, after the config check
        thread = threading.Thread(target=lambda: deleted.update(response=client.delete("/api/runs/racy")))
        thread.start()
        thread.join(2)  # done at once unless the resume holds the run
        deleted["thread"] = thread
        return real_check(*args)

    monkeypatch.setattr(api_runs, "check_relaunch", check_while_deleting)
    resumed = client.post("/api/runs/racy/resume", json={"max_train_steps": 100000})
    deleted["thread"].join(30)
    refused = deleted["response"]
    assert (resumed.status_code, refused.status_code) == (200, 409), (resumed.text, refused.text)
    assert "is starting" in refused.json()["detail"]["message"]
    client.post("/api/runs/racy/stop")


def test_a_killed_trainer_says_so(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path) -> None:
    """Case 34: the trainer is SIGKILLed (as the out-of-memory killer does): the run shows failed with
    the exit code, the step and the checkpoint to resume from, not its stale "started"."""
    client = TestClient(fake_app())
    client.post("/api/runs", json={"config": QUICKSTART, "name": "oom",
                                   "form": _form(sample_data, max_train_steps="100000", checkpointing_steps="3")})
    _wait(lambda: _view(client, "oom")["step"] >= 4, 30, "past its first checkpoint")
    os.kill(json.loads((runs_dir / "oom" / "run.lock").read_text())["pid"], signal.SIGKILL)
    view = _wait(lambda: (v := _view(client, "oom"))["state"] == "failed" and v, 30, "failed")
    assert view["message"] == f"exited with code 137 (killed: out of memory?) at step {view['step']}; resume from " \
                              f"{view['checkpoints'][-1]}", view["message"]


def test_a_cancelled_resume_leaves_a_finished_cli_run_finished(fake_app: Callable[..., Any], runs_dir: Path,
                                                               sample_data: Path) -> None:
    """Case 38: a run the CLI finished, resumed from the page to more steps, waits in the queue and is
    cancelled: it is still finished, with its own steps."""
    cli = runs_dir / "cli"
    _state_file(cli, 60)
    (cli / "checkpoint-60" / "trainer_state.json").write_text(json.dumps({"step": 60, "global_step": 60, "files": {}}))
    (cli / "config.yaml").write_text(QUICKSTART.replace("img_dir: data/sample_dataset", f"img_dir: {sample_data}"))
    (cli / "run_status.json").write_text(json.dumps({"state": "finished", "step": 60, "max_steps": 60,
                                                     "message": "done", "time": time.time()}))
    (cli / "summary.json").write_text(json.dumps({"family": "qwen_image", "outputs": {}}))
    client = TestClient(fake_app())
    client.post("/api/runs", json={"config": QUICKSTART, "name": "busy",
                                   "form": _form(sample_data, max_train_steps="100000")})
    assert client.post("/api/runs/cli/resume", json={"max_train_steps": 10 ** 6}).json()["state"] == "queued"
    assert client.post("/api/runs/cli/cancel").status_code == 200
    view = _view(client, "cli")
    assert (view["state"], view["step"], view["max_steps"], view["message"]) == ("finished", 60, 60, "done")
    client.post("/api/runs/busy/stop")


def test_runs_queue_and_queued_runs_can_be_cancelled(fake_app: Callable[..., Any], runs_dir: Path,
                                                     sample_data: Path) -> None:
    with TestClient(fake_app()) as client:  # one at a time (one CPU)
        body = {"config": QUICKSTART, "form": _form(sample_data)}
        long = {**body, "form": _form(sample_data, max_train_steps="100000")}
        assert client.post("/api/runs", json={**long, "name": "first"}).json()["state"] == "starting"
        assert client.post("/api/runs", json={**body, "name": "second"}).json()["state"] == "queued"
        assert client.post("/api/runs", json={**body, "name": "third", "form": _form(sample_data, max_train_steps="4")}
                           ).json()["state"] == "queued"
        listed = {r["id"]: r["state"] for r in client.get("/api/runs").json()}
        # the first may have begun its steps by now (a fast machine): starting or running, never queued
        assert listed["first"] in ("starting", "running") and (listed["second"], listed["third"]) == ("queued", "queued")
        assert client.post("/api/runs/second/stop").status_code == 409  # queued: cancel it instead
        assert client.post("/api/runs/second/cancel").json() == {"id": "second", "state": "cancelled"}
        assert client.post("/api/runs/second/cancel").status_code == 409
        assert client.delete("/api/runs/third").status_code == 409  # queued: never deleted from under the queue
        time.sleep(1.5)
        assert _view(client, "third")["state"] == "queued"  # still waiting for the first
        client.post("/api/runs/first/stop")
        _wait(lambda: _view(client, "third")["state"] in ("starting", "running", "finished"), 30, "third started")
        _wait(lambda: _view(client, "third")["state"] == "finished", 30, "third finished")
        assert _view(client, "second")["state"] == "cancelled" and "pid" not in json.loads(
            (runs_dir / "second" / "webui_launch.json").read_text())
        assert client.delete("/api/runs/second").status_code == 200


def test_a_queued_run_waits_across_a_restart_and_gpus_are_shared_out(fake_app: Callable[..., Any], runs_dir: Path,
                                                                     sample_data: Path) -> None:
    body = {"config": QUICKSTART, "form": _form(sample_data, max_train_steps="100000")}
    first = TestClient(fake_app())
    first.post("/api/runs", json={**body, "name": "a"})
    assert first.post("/api/runs", json={**body, "name": "b", "form": _form(sample_data, max_train_steps="3")}
                      ).json()["state"] == "queued"
    first.app.state.page.launcher.on_exit = lambda *args: None  # the first server is gone: nothing of it reacts
    # a new server over the same folder: "a" runs on, "b" still waits for it
    with TestClient(fake_app()) as again:
        assert {r["id"]: r["state"] for r in again.get("/api/runs").json()}.keys() >= {"a", "b"}
        _wait(lambda: _view(again, "a")["state"] == "running", 30, "a running, seen by the new server")
        assert _view(again, "b")["state"] == "queued"
        assert again.post("/api/runs/a/stop").status_code == 200  # an earlier server's child
        _wait(lambda: _view(again, "b")["state"] == "finished", 30, "b started by the new server once a ended")
    # two GPUs: two runs at once, one on each
    with TestClient(fake_app(runs=runs_dir / "gpus", max_concurrent=2, devices=["0", "1"])) as gpus:
        (runs_dir / "gpus").mkdir(exist_ok=True)
        ids = [gpus.post("/api/runs", json={**body, "name": f"g{i}"}).json() for i in range(3)]
        assert [i["state"] for i in ids] == ["starting", "starting", "queued"]
        env = [_wait(lambda i=i: (runs_dir / "gpus" / f"g{i}" / "fake_env.json").is_file(), 30, "started") and json.loads(
            (runs_dir / "gpus" / f"g{i}" / "fake_env.json").read_text())["CUDA_VISIBLE_DEVICES"] for i in range(2)]
        assert sorted(env) == ["0", "1"]
        gpus.post("/api/runs/g2/cancel")
        for i in range(2):
            gpus.post(f"/api/runs/g{i}/stop")


def test_the_queue_is_capped(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path) -> None:
    client = TestClient(fake_app())
    scheduler = client.app.state.page.scheduler
    assert scheduler.max_queued == 100  # the default
    scheduler.max_queued = 2
    body = {"config": QUICKSTART, "form": _form(sample_data, max_train_steps="100000")}
    assert client.post("/api/runs", json={**body, "name": "busy"}).json()["state"] == "starting"
    assert [client.post("/api/runs", json={**body, "name": f"wait{i}"}).json()["state"] for i in (1, 2)] == [
        "queued", "queued"]
    full = client.post("/api/runs", json={**body, "name": "wait3"})
    assert full.status_code == 429 and full.json()["detail"]["errors"] == [
        "the queue is full (2 runs waiting, at most 2): wait for some to start, or cancel some"]
    assert not (runs_dir / "wait3").exists()  # nothing of it written
    client.post("/api/runs/wait1/cancel")
    assert client.post("/api/runs", json={**body, "name": "wait3"}).json()["state"] == "queued"
    for run_id in ("wait2", "wait3"):
        client.post(f"/api/runs/{run_id}/cancel")
    client.post("/api/runs/busy/stop")


def test_one_plan_runs_at_a_time(client: TestClient, sample_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second --plan while one runs is answered 429 at once, in one line; the slot frees after
    each plan, failed or not."""
    entered, release = threading.Event(), threading.Event()
    calls: List[int] = []

    def slow_plan(*args: Any, **kwargs: Any) -> Dict[str, Any]:
        calls.append(1)
        entered.set()
        release.wait(30)
        return {"returncode": 0, "output": "GPU peak 1 GiB"}

    monkeypatch.setattr(runner, "plan", slow_plan)
    body = {"config": QUICKSTART, "form": _form(sample_data)}
    first: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: first.update(response=client.post("/api/plan", json=body)))
    thread.start()
    assert entered.wait(30)
    second = client.post("/api/plan", json=body)
    assert second.status_code == 429 and second.json()["detail"]["errors"] == [
        "another --plan is running (one at a time): try again when it has finished"]
    release.set()
    thread.join(30)
    assert first["response"].status_code == 200 and len(calls) == 1
    assert client.post("/api/plan", json=body).status_code == 200 and len(calls) == 2


def test_the_runs_list_parses_each_config_once(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The list is polled every 2 s: with 300 runs (CLI runs and queued page runs) a poll parses no
    YAML unless a config changed (OmegaConf took about 5 ms per run, 90% of the list's time)."""
    for i in range(150):
        cli_run = runs_dir / f"cli-{i}"
        cli_run.mkdir()
        (cli_run / "config.yaml").write_text(f"pretrained_model_name_or_path: m{i}\nmax_train_steps: {i + 1}\n")
        queued = runs_dir / f"queued-{i}"
        queued.mkdir()
        (queued / "webui_config.yaml").write_text("pretrained_model_name_or_path: base\nmax_train_steps: 5\n")
        (queued / "webui_launch.json").write_text(json.dumps({"queued": True, "queued_at": 1.0, "created": 1.0,
                                                              "overrides": [f"pretrained_model_name_or_path=q{i}"]}))
    from webui import runs

    parsed: List[str] = []
    real_load, real_merge = runs.OmegaConf.load, runs.OmegaConf.merge
    monkeypatch.setattr(runs.OmegaConf, "load", lambda path: parsed.append(str(path)) or real_load(path))
    monkeypatch.setattr(runs.OmegaConf, "merge", lambda *a: parsed.append("merge") or real_merge(*a))
    client = TestClient(create_app(runs_dir))
    listed = {r["id"]: r for r in client.get("/api/runs").json()}
    assert len(listed) == 304 and listed["cli-7"]["model"] == "m7" and listed["queued-7"]["model"] == "q7"
    first = len(parsed)
    assert 450 <= first <= 460  # each run's YAML and each queued run's overrides (plus the fixture's four runs)
    assert len(client.get("/api/runs").json()) == 304 and len(parsed) == first  # nothing parsed again
    (runs_dir / "cli-7" / "config.yaml").write_text("pretrained_model_name_or_path: changed\n")
    assert {r["id"]: r for r in client.get("/api/runs").json()}["cli-7"]["model"] == "changed"
    assert len(parsed) == first + 1


# -- clone, delete, checkpoints, dataset ---------------------------------------------------------------

def test_clone_delete_and_checkpoint_downloads(fake_app: Callable[..., Any], runs_dir: Path, sample_data: Path) -> None:
    client = TestClient(fake_app())
    form = _form(sample_data, max_train_steps="6", checkpointing_steps="3", rank="4")
    client.post("/api/runs", json={"config": QUICKSTART, "name": "orig", "form": form})
    _wait(lambda: _view(client, "orig")["state"] == "finished", 30, "finished")
    launched = client.get("/api/runs/orig/launch").json()
    assert launched["config"] == QUICKSTART and launched["entry"] == "train.py"
    assert launched["name"] == "orig-2"  # a clone is named after its source
    assert launched["values"] == {"data_config.img_dir": str(sample_data), "max_train_steps": "6",
                                  "checkpointing_steps": "3", "rank": "4"}
    assert client.get("/api/runs/live/launch").json()["config"].startswith("family: qwen_image")  # a CLI run's config.yaml
    view = _view(client, "orig")
    files = {c["name"]: c for c in view["checkpoint_files"]}
    assert files["checkpoint-6"]["weights"] == ["checkpoint-6/pytorch_lora_weights.safetensors"]
    assert client.get("/api/runs/orig/files/checkpoint-6/pytorch_lora_weights.safetensors").content == b"lora at 6"
    archive = zipfile.ZipFile(io.BytesIO(client.get("/api/runs/orig/checkpoints/checkpoint-6.zip").content))
    folder = runs_dir / "orig" / "checkpoint-6"
    assert {n: archive.read(n) for n in archive.namelist()} == {
        f"checkpoint-6/{p.name}": p.read_bytes() for p in folder.iterdir()}
    assert client.get("/api/runs/orig/checkpoints/checkpoint-5.zip").status_code == 404
    assert client.delete("/api/runs/live").status_code == 409  # running (a CLI run's lock)
    assert client.delete("/api/runs/orig").json() == {"id": "orig", "deleted": True}
    assert not (runs_dir / "orig").exists() and not list(runs_dir.glob(".deleting-*"))
    assert client.get("/api/runs/orig").status_code == 404
    assert client.delete("/api/runs/..%2Fsecret.txt").status_code == 404


def test_a_runs_dataset_shows_and_saves_captions(client: TestClient, runs_dir: Path, tmp_path: Path,
                                                 sample_data: Path) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    (runs_dir / "done" / "config.yaml").write_text(f"data_config:\n  img_dir: {data}\n  caption_type: txt\n")
    listed = client.get("/api/runs/done/dataset").json()
    assert listed["caption_model"] == "Qwen/Qwen3-VL-2B-Instruct"  # "Caption this folder": tests/test_webui_captioning.py
    folder = listed["folders"][0]
    images = sorted(p for p in data.iterdir() if p.suffix in (".png", ".jpg", ".jpeg", ".webp"))
    assert folder["total"] == len(images) == len(folder["items"])
    assert {i["image"]: i["caption"] for i in folder["items"]} == {
        p.name: p.with_suffix(".txt").read_text().strip() for p in images}
    first = folder["items"][0]["image"]
    assert client.get(f"/api/runs/done/dataset/0/images/{first}").content == (data / first).read_bytes()
    saved = client.post("/api/runs/done/dataset/0/captions", json={"image": first, "caption": "  a new caption  "})
    assert saved.json() == {"image": first, "caption_file": Path(first).with_suffix(".txt").name}
    assert (data / first).with_suffix(".txt").read_text() == "a new caption\n"
    assert client.get("/api/runs/done/dataset").json()["folders"][0]["items"][0]["caption"] == "a new caption"
    for bad in ({"image": Path(first).with_suffix(".txt").name, "caption": "x"}, {"image": "../secret.txt", "caption": "x"},
                {"image": "missing.png", "caption": "x"}):
        assert client.post("/api/runs/done/dataset/0/captions", json=bad).status_code == 404, bad
    assert client.post("/api/runs/done/dataset/0/captions", json={"image": first, "caption": "x" * 20_001}).status_code == 422
    assert client.get("/api/runs/done/dataset/1/images/x.png").status_code == 404
    assert not (tmp_path / "secret.txt.txt").exists()


def test_dataset_captions_are_read_only_inside_the_folder_and_odd_names_work(client: TestClient, runs_dir: Path,
                                                                             tmp_path: Path, sample_data: Path) -> None:
    """Case 24: a caption file that is a link to a file outside the folder is not read (and saving
    replaces the link, not its target). Case 20: an image whose name holds a backslash is shown and
    its caption saved (on POSIX a backslash is a name's character, not a separator)."""
    data = tmp_path / "odd"
    data.mkdir()
    image = (sample_data / "img1.png").read_bytes()
    for name in ("linked.png", "<b>bold<\\b>.png", "inside.png"):
        (data / name).write_bytes(image)
    (data / "linked.txt").symlink_to(tmp_path / "secret.txt")
    (data / "inside-words.md").write_text("words kept inside\n")
    (data / "inside.txt").symlink_to(data / "inside-words.md")  # a link within the folder is read
    (runs_dir / "done" / "config.yaml").write_text(f"data_config:\n  img_dir: {data}\n  caption_type: txt\n")
    items = {i["image"]: i["caption"] for i in client.get("/api/runs/done/dataset").json()["folders"][0]["items"]}
    assert items == {"<b>bold<\\b>.png": None, "inside.png": "words kept inside", "linked.png": None}
    assert SECRET not in json.dumps(items)
    odd = "/api/runs/done/dataset/0/images/" + "%3Cb%3Ebold%3C%5Cb%3E.png"
    assert client.get(odd).content == image
    saved = client.post("/api/runs/done/dataset/0/captions", json={"image": "<b>bold<\\b>.png", "caption": "bold"})
    assert saved.status_code == 200 and (data / "<b>bold<\\b>.txt").read_text() == "bold\n"
    assert client.post("/api/runs/done/dataset/0/captions", json={"image": "linked.png", "caption": "mine"}
                       ).status_code == 200
    assert (data / "linked.txt").read_text() == "mine\n" and not (data / "linked.txt").is_symlink()
    assert (tmp_path / "secret.txt").read_text() == SECRET


# -- the real server: Ctrl-C with pages open, runs that go on, a restart ---------------------------

SERVE = r'''
import runpy, sys
root, fake = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
from webui import runner
class FakeLauncher(runner.Launcher):  # the stand-in for trainer.launch, as in the API tests
    def __init__(self, launcher_args=None, command=None):
        super().__init__(command=[sys.executable, fake])
runner.Launcher = FakeLauncher
sys.argv = [root + "/webui.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _serve(runs_dir: Path, port: int, log: Path, token: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SERVE, str(ROOT), str(FAKE), "--runs-dir", str(runs_dir),
                             "--port", str(port)], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "WEBUI_TOKEN": token}, start_new_session=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _up(base: str, server: subprocess.Popen) -> None:
    def answers() -> bool:
        assert server.poll() is None, "the server exited"
        try:
            return httpx.get(f"{base}/api/runs", timeout=2).status_code == 401
        except httpx.HTTPError:
            return False

    _wait(answers, 90, "the server answering")


def test_ctrl_c_stops_the_server_with_pages_open_and_its_runs_go_on(tmp_path: Path, sample_data: Path) -> None:
    runs_dir, log, token = tmp_path / "runs", tmp_path / "server.log", "tok-9f8e7d6c5b4a"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = _serve(runs_dir, port, log, token)
    try:
        _up(base, server)
        http = httpx.Client(base_url=base, follow_redirects=False, timeout=10)
        assert http.get(f"/?token={token}").status_code == 303  # the browser's way in: a cookie from now on
        body = {"config": QUICKSTART, "name": "survivor", "form": _form(sample_data, max_train_steps="100000")}
        assert http.post("/api/runs", json=body).json()["id"] == "survivor"
        _wait(lambda: http.get("/api/runs/survivor").json()["state"] == "running", 30, "the run running")
        opened = []

        def watch() -> None:  # two open run pages (event streams)
            with http.stream("GET", "/api/runs/survivor/events", timeout=None) as events:
                for line in events.iter_lines():
                    if line.startswith("data:"):
                        opened.append(line)
        watchers = [threading.Thread(target=watch, daemon=True) for _ in range(2)]
        for w in watchers:
            w.start()
        _wait(lambda: len(opened) >= 2, 30, "both pages receiving events")
        # taken: a second page on the same runs folder is refused
        other = subprocess.run([sys.executable, "-c", SERVE, str(ROOT), str(FAKE), "--runs-dir", str(runs_dir),
                                "--port", str(_free_port())], capture_output=True, text=True, timeout=120)
        assert other.returncode == 2 and "another web page serves" in other.stderr
        began = time.monotonic()
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in the terminal: the server's process group
        server.wait(timeout=30)
        stopped_in = time.monotonic() - began
        assert stopped_in < 5, f"the server took {stopped_in:.1f} s to stop"
        print(f"Ctrl-C with two pages open: the server stopped in {stopped_in:.2f} s")
        lock = json.loads((runs_dir / "survivor" / "run.lock").read_text())
        os.kill(lock["pid"], 0)  # the run goes on
        step = json.loads((runs_dir / "survivor" / "run_status.json").read_text())["step"]
        # restarted: the run is shown running again, and can be stopped from the new server
        server = _serve(runs_dir, port, log, token)
        _up(base, server)
        http = httpx.Client(base_url=base, headers={"X-Token": token}, timeout=10)
        view = http.get("/api/runs/survivor").json()
        assert view["state"] == "running" and view["step"] >= step
        assert http.post("/api/runs/survivor/stop").status_code == 200
        _wait(lambda: http.get("/api/runs/survivor").json()["state"] == "stopped", 30, "stopped by the new server")
        assert http.get("/api/runs/survivor").json()["checkpoints"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        for lock in runs_dir.glob("*/run.lock"):
            try:
                os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    output = log.read_text()
    assert token not in output and "Traceback" not in output, output
