"""The page's "Caption this folder" (``webui/captioning.py``): caption.py as a child process on a
tiny random vision-language model, its state read back from its files, existing captions kept, one
job per folder, a model that cannot load named, and a model name that looks like an option kept a
value. A captioner left running by a server killed with ``kill -9`` is seen by the next server (a
stand-in captioner, tests/webui_fake_captioner.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Dict

import pytest

pytest.importorskip("fastapi", reason="the web page needs fastapi (requirements.txt)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (requirements.txt)")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from utils.tiny_models import build_tiny_vlm  # noqa: E402
from webui.children import recorded_alive  # noqa: E402
from webui.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen3-vl", architecture="qwen3_vl")


@pytest.fixture
def page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    """A run whose config trains on a folder of three images, one with a caption (a ``.caption`` file:
    the folder's caption_type, not txt), and the app serving it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = tmp_path / "data"
    data.mkdir()
    for i, colour in enumerate(("red", "green", "blue")):
        Image.new("RGB", (64, 64), colour).save(data / f"img{i}.png")
    (data / "img0.caption").write_text("my own words\n")
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"data_config:\n  img_dir: {data}\n  caption_type: caption\n")
    return {"data": data, "run": run, "client": TestClient(create_app(tmp_path / "runs"))}


def _wait_end(client: TestClient, url: str, seconds: float = 240) -> Dict[str, Any]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = client.get(url).json()
        if state["state"] != "running":
            return state
        time.sleep(0.2)
    raise AssertionError(f"captioning did not end within {seconds} s")


URL = "/api/runs/mine/dataset/0/caption-folder"
FAKE = Path(__file__).resolve().parent / "webui_fake_captioner.py"


def test_caption_this_folder_writes_missing_captions_and_keeps_the_users(page: Dict[str, Any], tiny_vlm: Path) -> None:
    client, data = page["client"], page["data"]
    assert client.get(URL).json() == {"state": "none"}
    started = client.post(URL, json={"model": str(tiny_vlm), "trigger_word": "ohwx"})
    assert started.status_code == 200, started.text
    again = client.post(URL, json={"model": str(tiny_vlm)})
    if again.status_code != 409:  # the tiny model can finish before the second request: then it is a new job
        assert again.status_code == 200
    else:
        assert "being captioned already" in again.json()["detail"]["message"]
    state = _wait_end(client, URL)
    assert state["state"] == "done", state
    assert (data / "img0.caption").read_text() == "my own words\n"  # kept: no overwrite asked
    for i in (1, 2):
        text = (data / f"img{i}.caption").read_text()
        assert text.startswith("ohwx") or again.status_code == 200, text
        assert not (data / f"img{i}.txt").exists()  # the folder's caption_type, not caption.py's default
    assert state["failed"] == 0 and state["captioned"] + state["skipped"] == 3
    listed = client.get("/api/runs/mine/dataset").json()["folders"][0]["items"]
    assert all(item["caption"] for item in listed)  # the page shows them beside the images

    replaced = client.post(URL, json={"model": str(tiny_vlm), "overwrite": True})
    assert replaced.status_code == 200
    state = _wait_end(client, URL)
    assert state["state"] == "done" and state["captioned"] == 3, state
    assert (data / "img0.caption").read_text() != "my own words\n"


def test_a_model_that_cannot_load_is_named_and_an_option_like_name_stays_a_value(page: Dict[str, Any]) -> None:
    client, data = page["client"], page["data"]
    for model in (str(page["run"] / "no-such-model"), "--overwrite"):
        assert client.post(URL, json={"model": model}).status_code == 200
        state = _wait_end(client, URL)
        assert state["state"] == "failed" and state["returncode"] == 2, state
        assert state["error"].startswith(f"error: --model {model}: cannot load it"), state["error"]
        assert (data / "img0.caption").read_text() == "my own words\n"
        assert not (data / "img1.caption").exists()


def test_bad_requests(page: Dict[str, Any], tmp_path: Path) -> None:
    client = page["client"]
    assert client.post("/api/runs/mine/dataset/1/caption-folder", json={}).status_code == 404
    assert client.post(URL, json={"model": ""}).status_code == 422
    blank = client.post(URL, json={"model": " \t "})  # nothing to load: refused before a child starts
    assert blank.status_code == 422 and "model" in blank.json()["detail"]["message"]
    assert not (page["run"] / "captioning").exists()
    assert client.post(URL, json={"model": "x", "overwrite": "maybe"}).status_code == 422
    assert client.post("/api/runs/..%2Fx/dataset/0/caption-folder", json={}).status_code == 404
    assert client.post(URL, json={}, headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
                       ).status_code == 403
    page["data"].rename(tmp_path / "moved")
    missing = client.post(URL, json={})
    assert missing.status_code == 404 and "does not exist" in missing.json()["detail"]["message"]


def _fake_captioner(client: TestClient) -> TestClient:
    client.app.state.page.captions.script = FAKE
    return client


def test_a_captioner_left_by_a_killed_server_is_seen_refused_and_stopped(page: Dict[str, Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 23: the server dies (``kill -9``: nothing of it runs any more) while its captioner goes on in
    its own session. The next server shows the job running, refuses a second one on the folder (any
    run's), stops the first, and a new job writes new files: the old job's lines are never truncated."""
    monkeypatch.setenv("WEBUI_TOKEN", "the-page-secret")
    monkeypatch.setenv("FAKE_CAPTION_S", "60")  # the first image takes a minute: it runs until stopped
    first = _fake_captioner(page["client"])
    assert first.post(URL, json={"model": "m"}).status_code == 200
    (orphan,) = first.app.state.page.captions.children.values()
    first_log = page["run"] / "captioning" / "folder-0.job-1.log"
    deadline = time.monotonic() + 60
    while not (first_log.is_file() and first_log.read_text()) and time.monotonic() < deadline:  # the captioner is up
        time.sleep(0.1)
    # a new server over the same runs folder knows nothing of the first one's child
    again = _fake_captioner(TestClient(create_app(page["run"].parent)))
    assert again.get(URL).json()["state"] == "running"
    refused = again.post(URL, json={"model": "m"})
    assert refused.status_code == 409 and f"(pid {orphan.pid})" in refused.json()["detail"]["message"]
    record = json.loads((page["run"] / "captioning" / "folder-0.json").read_text())
    assert recorded_alive(record) and (record["job"], record["pid"]) == (1, orphan.pid)
    other = page["run"].parent / "other"  # another run training on the same image folder
    other.mkdir()
    (other / "config.yaml").write_text((page["run"] / "config.yaml").read_text())
    assert again.post("/api/runs/other/dataset/0/caption-folder", json={"model": "m"}).status_code == 409
    stopped = again.post(f"{URL}/stop")
    assert stopped.status_code == 200 and stopped.json()["signalled"] == orphan.pid
    assert orphan.wait(timeout=30) == -signal.SIGTERM
    assert again.get(URL).json()["state"] == "interrupted"
    assert again.post(f"{URL}/stop").status_code == 409  # nothing runs now
    monkeypatch.setenv("FAKE_CAPTION_S", "0")
    assert again.post(URL, json={"model": "m"}).status_code == 200
    state = _wait_end(again, URL)
    assert state["state"] == "done" and state["captioned"] == 3, state
    files = sorted(p.name for p in (page["run"] / "captioning").iterdir())
    assert files == ["folder-0.job-1.jsonl", "folder-0.job-1.log", "folder-0.job-2.jsonl", "folder-0.job-2.log",
                     "folder-0.json"]
    assert (page["run"] / "captioning" / "folder-0.job-1.jsonl").read_bytes() == b""  # stopped before its first image
    for job in (1, 2):  # the page's token is no child's business
        log = (page["run"] / "captioning" / f"folder-0.job-{job}.log").read_text()
        assert log.splitlines()[0] == "WEBUI_TOKEN not given", log
