"""The web page in a real headless browser (Debian's chromium + chromium-driver through selenium,
installed by scripts/setup_browser.sh; skipped, saying why, where they are missing).

Two tests:
- real runs of the tiny Qwen-Image model: the quick-start profile started from the form's essentials
  (a bad value first shows the CLI's error; then the plan; the run shows "starting" at once, the step
  counter, loss plot and samples with their prompt text update live, a sample opens large with a
  step slider; the LoRA downloads), a second run queued behind it and started when it ends, stopped
  with the page's button and resumed (shown starting at once, not "stopped");
- the run-management flows with the stand-in launcher (tests/webui_fake_launcher.py): replacing a
  run by name asks first, a queued run is cancelled from the list, clone fills a new form, resume
  with more steps, a caption is edited and saved, a checkpoint downloads as a zip, a run is deleted
  after a confirmation, an unknown run says so.
Screenshots are kept in ``test-artifacts/`` (``WEBUI_ARTIFACTS`` to change).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("WEBUI_ARTIFACTS", ROOT / "test-artifacts"))
QUICKSTART = (ROOT / "train_configs" / "quickstart_tiny.yaml").read_text()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _missing() -> str:
    """Why the browser test cannot run here ('' when it can)."""
    for module in ("selenium", "fastapi", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -r requirements.txt)"
    if not (CHROMIUM and CHROMEDRIVER):
        return "chromium and chromium-driver are not installed (bash scripts/setup_browser.sh, as root with apt-get)"
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "runs")


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """``serve(runs_dir, fake=False)``: the page served by uvicorn on a free localhost port (runs
    through the stand-in launcher with ``fake``); returns its address."""
    import uvicorn

    from webui import runner
    from webui.server import create_app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # inherited by the runs: the tiny model is local
    started: List[Any] = []

    def start(runs_dir: Path, fake: bool = False) -> str:
        launcher = runner.Launcher(command=[sys.executable, str(ROOT / "tests" / "webui_fake_launcher.py")]) if fake else None
        app = create_app(runs_dir, allowed_hosts=["127.0.0.1", "localhost"], launcher=launcher)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        started.append((app, server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for app, server, thread in started:
        app.state.page.launcher.on_exit = lambda *args: None  # nothing queued starts while they go
        for child in list(app.state.page.launcher.children.values()):  # a failed test leaves no run behind
            if child.poll() is None:
                child.terminate()  # passed on to the trainer, which exits
                child.wait(timeout=60)
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1700"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


class Page:
    """Helpers over the selenium driver."""

    def __init__(self, driver: Any, base: str):
        from selenium.webdriver.common.by import By

        self.driver, self.base, self.by = driver, base, By

    def find(self, css: str) -> Any:
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def all(self, css: str) -> List[Any]:
        return self.driver.find_elements(self.by.CSS_SELECTOR, css)

    def wait(self, condition: Callable[[], Any], seconds: float, what: str) -> Any:
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, seconds, poll_frequency=0.2,
                             ignored_exceptions=(StaleElementReferenceException,)).until(lambda _: condition(), what)

    def go(self, hash_: str) -> None:
        self.driver.get(f"{self.base}/{hash_}")

    def field(self, key: str, value: str) -> None:
        element = self.find(f'.form [data-key="{key}"]')
        element.clear()
        element.send_keys(value)

    def state(self) -> str:
        return self.find("#state").text

    def step(self) -> int:
        return int(re.search(r"step (\d+)", self.find("#step").text).group(1))

    def listed(self) -> dict:
        return {row.get_attribute("data-run"): row.find_element(self.by.CSS_SELECTOR, ".col-state").text
                for row in self.all("#runs tbody tr")}

    def confirm(self, accept: bool) -> str:
        """Answer the page's confirm() dialog; returns its text."""
        self.wait(lambda: self._alert() is not None, 10, "a confirmation asked")
        alert = self.driver.switch_to.alert
        text = alert.text
        alert.accept() if accept else alert.dismiss()
        return text

    def _alert(self) -> Any:
        from selenium.common.exceptions import NoAlertPresentException

        try:
            return self.driver.switch_to.alert
        except NoAlertPresentException:
            return None


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request))


def _shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.driver.save_screenshot(str(ARTIFACTS / name))


def test_start_watch_queue_stop_and_resume_real_runs(serve: Callable[..., str], browser: Any, tmp_path: Path,
                                                     tiny_qwen_image: Path, sample_data: Path) -> None:
    from selenium.webdriver.support.ui import Select

    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    page = Page(browser, serve(runs_dir))
    plotted = lambda: int(page.find('#loss-plot polyline[data-series="loss"]').get_attribute("data-count") or 0)  # noqa: E731

    # -- the quick-start profile from the form's essentials, with two sample prompts every 20 steps --
    page.go("#/start")
    page.wait(lambda: len(Select(page.find("#profile")).options) > 1, 30, "profiles listed")
    assert [e.get_attribute("data-key") for e in page.all("#form-common [data-key]")][:4] == [
        "pretrained_model_name_or_path", "data_config.img_dir", "data_config.trigger_word", "max_train_steps"]
    assert not page.find('#form [data-key="validation.width"]').is_displayed()  # under "advanced"
    Select(page.find("#profile")).select_by_value("quickstart_tiny.yaml")
    page.wait(lambda: page.find('.form [data-key="max_train_steps"]').get_attribute("value") == "60", 30, "profile in the form")
    prompts = '["a red square", "a blue circle"]'
    essentials = {"pretrained_model_name_or_path": str(tiny_qwen_image), "data_config.img_dir": str(sample_data),
                  "validation.prompts": prompts, "validation.every_n_steps": "20"}
    for key, value in essentials.items():
        page.field(key, value)
    page.find("#advanced summary").click()
    advanced = {"validation.width": "64", "validation.height": "64", "validation.steps": "2"}
    for key, value in advanced.items():
        page.field(key, value)
    page.find("#run-name").send_keys("quick")
    page.field("max_train_steps", "sixty")  # the CLI's error, and nothing starts
    page.find("#launch").click()
    page.wait(lambda: "key 'max_train_steps': value 'sixty' is not a valid integer" in page.find("#errors").text, 60,
              "the error")
    assert not (runs_dir / "quick").exists()
    page.field("max_train_steps", "60")
    page.find("#check").click()
    page.wait(lambda: "Memory plan" in page.find("#plan").text, 240, "the plan")
    page.find("#launch").click()
    page.wait(lambda: browser.execute_script("return location.hash") == "#/run/quick", 60, "the run's page")
    page.wait(lambda: page.state() in ("starting", "running"), 10, "starting at once")
    launched = json.loads((runs_dir / "quick" / "webui_launch.json").read_text())
    edits = {**essentials, **advanced}
    assert sorted(launched["overrides"]) == sorted(  # the edited keys only; text quoted, numbers and YAML as typed
        f'{k}={json.dumps(v) if "_dir" in k or "model" in k else v}' for k, v in edits.items())

    # -- a second run, through the API, queued behind the first (one run at a time on this machine) --
    long = {"pretrained_model_name_or_path": str(tiny_qwen_image), "data_config.img_dir": str(sample_data),
            "max_train_steps": "100000", "checkpointing_steps": "100000"}
    assert _post(f"{page.base}/api/runs", {"config": QUICKSTART, "form": long, "name": "long"}) == {
        "id": "long", "state": "queued"}

    page.wait(lambda: page.step() > 0 and plotted() > 0, 240, "the step counter and the loss plot")
    assert page.find("#step").text.endswith("/ 60")
    first = (page.step(), plotted())
    page.wait(lambda: page.step() > first[0] and plotted() > first[1], 120, "the step counter and the loss plot updating")
    sample = '#samples .samples-row:not([data-step="0"]) img'
    page.wait(lambda: browser.execute_script(f"const i = document.querySelector('{sample}'); return i && i.complete && "
                                             "i.naturalWidth > 0"), 240, "a validation sample after training steps")
    page.wait(lambda: [c.text for c in page.all('#samples .samples-row:not([data-step="0"]) figcaption')] == [
        "a red square", "a blue circle"], 120, "both samples of the step, each with its prompt")
    page.find(sample).click()  # the large view, with its step slider
    page.wait(lambda: page.find("#lightbox").is_displayed(), 10, "the large view")
    assert page.find("#lightbox-caption").text.endswith("a red square") and page.find("#lightbox-caption").text.startswith("step ")
    browser.execute_script("const s = document.querySelector('#lightbox-step'); s.value = 0; s.dispatchEvent(new Event('input'));")
    assert page.find("#lightbox-caption").text == "base model · a red square"
    assert int(browser.execute_script("return document.querySelector('#lightbox-img').naturalWidth")) > 0
    page.find("#lightbox-close").click()
    page.wait(lambda: page.state() == "finished", 300, "the quick-start run finished")
    page.wait(lambda: page.find("#download").is_displayed(), 30, "the LoRA download link")
    lora = urllib.request.urlopen(page.find("#download").get_attribute("href")).read()
    assert lora == (runs_dir / "quick" / "pytorch_lora_weights.safetensors").read_bytes()
    assert page.find("#planned-peak").text.startswith("plan: GPU peak")
    _shot(page, "webui_run.png")

    # -- the queued run started when the first ended; stopped with the button, resumed -------------
    page.go("#/run/long")
    page.wait(lambda: page.state() == "running" and page.step() > 0, 300, "the long run training")
    page.wait(lambda: re.fullmatch(r"\d+(\.\d+)? (s|min|h)", page.find("#eta").text), 60, "its ETA from the metrics' times")
    page.find("#stop").click()
    page.wait(lambda: page.state() == "stopped", 120, "the long run stopped")
    page.wait(lambda: page.all("#checkpoints tbody tr"), 30, "its checkpoint listed")
    name = page.find("#checkpoints tbody tr").get_attribute("data-checkpoint")
    assert (runs_dir / "long" / name / "trainer_state.json").is_file()
    page.wait(lambda: page.find("#resume").is_enabled(), 10, "resume offered")
    page.find("#resume").click()
    seen = page.wait(lambda: page.state() if page.state() in ("starting", "running") else None, 5,
                     "starting at once after Resume")  # run_status.json still says "stopped" for a while
    assert seen in ("starting", "running") and not page.find("#resume").is_enabled()
    page.wait(lambda: page.state() == "running" and page.find("#stop").is_enabled(), 240, "running again")
    page.find("#stop").click()
    page.wait(lambda: page.state() == "stopped", 120, "stopped again")

    page.go("#/")
    page.wait(lambda: len(page.all("#runs tbody tr")) == 2, 30, "both runs listed")
    assert page.listed() == {"quick": "finished", "long": "stopped"}
    speeds = [float(cell.text) for cell in page.all("#runs tbody td.col-speed")]
    assert len(speeds) == 2 and all(0 < s < 60 for s in speeds)  # s/step
    assert all(cell.text != "-" for cell in page.all("#runs tbody td.col-started"))
    assert all(re.fullmatch(r"\d+ (s|min)", cell.text) for cell in page.all("#runs tbody td.col-duration"))
    _shot(page, "webui_runs.png")


def test_manage_runs_in_the_page(serve: Callable[..., str], browser: Any, tmp_path: Path, sample_data: Path) -> None:
    runs_dir, data = tmp_path / "runs", tmp_path / "data"
    runs_dir.mkdir()
    shutil.copytree(sample_data, data)
    page = Page(browser, serve(runs_dir, fake=True))
    form = {"data_config.img_dir": str(data), "max_train_steps": "6", "checkpointing_steps": "3", "rank": "4"}
    assert _post(f"{page.base}/api/runs", {"config": QUICKSTART, "name": "taken", "form": form})["id"] == "taken"

    # an unknown run says so, and offers nothing
    page.go("#/run/nope")
    page.wait(lambda: "no run 'nope'" in page.find("#message").text, 10, "the unknown run's message")
    assert not page.find("#stop").is_enabled() and not page.find("#delete").is_enabled()

    # the finished run: its checkpoint as a zip, its dataset's captions edited and saved
    page.go("#/run/taken")
    page.wait(lambda: page.state() == "finished", 30, "the first run finished")
    page.wait(lambda: len(page.all("#checkpoints tbody tr")) == 2, 10, "its checkpoints")
    assert "No samples yet" in page.find("#samples").text
    assert not page.find("#sample-controls").is_displayed()  # no step slider without samples (case 45)
    zipped = urllib.request.urlopen(page.find('#checkpoints tr[data-checkpoint="checkpoint-6"] a.zip').get_attribute("href"))
    assert sorted(zipfile.ZipFile(io.BytesIO(zipped.read())).namelist()) == [
        "checkpoint-6/optimizer.bin", "checkpoint-6/pytorch_lora_weights.safetensors", "checkpoint-6/trainer_state.json"]
    page.find("#dataset-box summary").click()
    page.wait(lambda: len(page.all(".dataset-item")) == 6, 20, "the dataset's images")
    item = page.find(".dataset-item")
    image = item.get_attribute("data-image")
    assert item.find_element(page.by.CSS_SELECTOR, "textarea").get_attribute("value") == \
        (data / image).with_suffix(".txt").read_text().strip()
    assert page.find(".caption-folder .caption-start").is_enabled()  # run: tests/test_webui_captioning.py
    assert not page.find(".caption-folder .caption-stop").is_displayed()  # nothing to stop
    assert page.find(".caption-folder .caption-model").get_attribute("value") == "Qwen/Qwen3-VL-2B-Instruct"
    caption = item.find_element(page.by.CSS_SELECTOR, "textarea")
    caption.clear()
    caption.send_keys("ohwx, a hand-edited caption")
    item.find_element(page.by.CSS_SELECTOR, ".save-caption").click()
    page.wait(lambda: item.find_element(page.by.CSS_SELECTOR, ".saved").text == "saved", 10, "the caption saved")
    assert (data / image).with_suffix(".txt").read_text() == "ohwx, a hand-edited caption\n"

    # resume with more steps: starting at once, then finished at the new count
    steps = page.find("#resume-steps")
    steps.clear()
    steps.send_keys("12")
    page.find("#resume").click()
    page.wait(lambda: page.state() in ("starting", "running"), 5, "starting at once")
    page.wait(lambda: page.state() == "finished" and page.find("#step").text == "step 12 / 12", 30, "12 steps")

    # clone: a new form with the run's YAML and its edits
    page.find("#clone").click()
    page.wait(lambda: browser.execute_script("return location.hash") == "#/start?clone=taken", 10, "the start form")
    page.wait(lambda: page.find('.form [data-key="rank"]').get_attribute("value") == "4", 30, "the run's edits filled in")
    assert page.find("#yaml").get_attribute("value") == QUICKSTART and "taken" in page.find("#clone-note").text
    assert page.find('.form [data-key="max_train_steps"]').get_attribute("value") == "12"
    assert "changed" in page.find('.form [data-key="rank"]').find_element(page.by.XPATH, "..").get_attribute("class")
    assert page.find("#run-name").get_attribute("value") == "taken-2"  # named after its source

    # naming an existing run: the page asks before replacing it; no: nothing changes
    page.field("max_train_steps", "100000")
    page.find("#run-name").clear()
    page.find("#run-name").send_keys("taken")
    kept = (runs_dir / "taken" / "checkpoint-12" / "pytorch_lora_weights.safetensors").read_bytes()
    page.find("#launch").click()
    assert "Replace it?" in page.confirm(accept=False)
    page.wait(lambda: "a run named 'taken' exists" in page.find("#errors").text, 10, "why it did not start")
    assert (runs_dir / "taken" / "checkpoint-12" / "pytorch_lora_weights.safetensors").read_bytes() == kept
    page.find("#launch").click()
    page.confirm(accept=True)
    page.wait(lambda: browser.execute_script("return location.hash") == "#/run/taken", 10, "the new run's page")
    page.wait(lambda: page.state() == "running", 30, "the replacement running")
    assert not (runs_dir / "taken" / "summary.json").exists()  # the old run's outputs went with it
    assert not (runs_dir / "taken" / "pytorch_lora_weights.safetensors").exists()

    # a second run waits as queued; cancelled from the list
    assert _post(f"{page.base}/api/runs", {"config": QUICKSTART, "name": "waiting", "form": form})["state"] == "queued"
    page.go("#/")
    page.wait(lambda: page.listed().get("waiting") == "queued", 10, "queued in the list")
    page.find('tr[data-run="waiting"] button.cancel').click()
    page.wait(lambda: page.listed().get("waiting") == "cancelled", 10, "cancelled")
    _shot(page, "webui_manage.png")

    # delete asks first; a running run cannot be deleted
    page.go("#/run/taken")
    page.wait(lambda: page.state() == "running", 10, "the running run")
    assert not page.find("#delete").is_enabled()
    page.go("#/run/waiting")
    page.wait(lambda: page.state() == "cancelled" and page.find("#delete").is_enabled(), 10, "the cancelled run")
    page.find("#delete").click()
    assert "Delete run 'waiting'?" in page.confirm(accept=False)
    assert (runs_dir / "waiting").is_dir()
    page.find("#delete").click()
    page.confirm(accept=True)
    page.wait(lambda: browser.execute_script("return location.hash") == "#/", 10, "back to the list")
    page.wait(lambda: "waiting" not in page.listed(), 10, "gone from the list")
    assert not (runs_dir / "waiting").exists()
    page.go("#/run/taken")
    page.wait(lambda: page.find("#stop").is_enabled(), 10, "stop offered")
    page.find("#stop").click()
    page.wait(lambda: page.state() == "stopped", 30, "stopped")
