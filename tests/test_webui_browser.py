"""The web page in a real headless browser (Debian's chromium + chromium-driver through selenium,
installed by scripts/setup_browser.sh; skipped, saying why, where they are missing).

One test, two real runs of the tiny Qwen-Image model: the quick-start profile started from the form
(a bad value first shows the CLI's error; then the plan, and the step counter, loss plot and a
validation sample update live; the LoRA downloads), and a long run
started through the API and stopped with the page's button (stopped, with a checkpoint). Screenshots
are kept in ``test-artifacts/`` (``WEBUI_ARTIFACTS`` to change).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

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
def page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[str, Path]]:
    """The page served by uvicorn on a free localhost port, over an empty runs folder."""
    import uvicorn

    from webui.server import create_app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # inherited by the runs: the tiny model is local
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    app = create_app(runs_dir, allowed_hosts=["127.0.0.1", "localhost"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", runs_dir
    for child in app.state.launcher.children.values():  # a failed test leaves no run behind
        if child.poll() is None:
            os.killpg(child.pid, 9)
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


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request))


def test_start_watch_and_stop_runs_in_the_page(page: Tuple[str, Path], browser: Any, tiny_qwen_image: Path,
                                               sample_data: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, runs_dir = page
    find = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731

    def wait(condition: Callable[[], Any], seconds: float, what: str) -> Any:
        return WebDriverWait(browser, seconds, poll_frequency=0.2).until(lambda _: condition(), what)

    def field(key: str, value: str) -> None:
        element = find(f'#form [data-key="{key}"]')
        element.clear()
        element.send_keys(value)

    step = lambda: int(re.search(r"step (\d+)", find("#step").text).group(1))  # noqa: E731
    plotted = lambda: int(find('#loss-plot polyline[data-series="loss"]').get_attribute("data-count") or 0)  # noqa: E731

    # -- the quick-start profile from the form, with samples every 20 steps ----------------------
    browser.get(f"{base}/#/start")
    wait(lambda: len(Select(find("#profile")).options) > 1, 30, "profiles listed")
    Select(find("#profile")).select_by_value("quickstart_tiny.yaml")
    wait(lambda: find('#form [data-key="max_train_steps"]').get_attribute("value") == "60", 30, "profile in the form")
    edits = {"pretrained_model_name_or_path": str(tiny_qwen_image), "data_config.img_dir": str(sample_data),
             "validation.every_n_steps": "20", "validation.width": "64", "validation.height": "64", "validation.steps": "2"}
    for key, value in edits.items():
        field(key, value)
    find("#run-name").send_keys("quick")
    field("max_train_steps", "sixty")  # the CLI's error, before anything starts
    find("#check").click()
    wait(lambda: "key 'max_train_steps': value 'sixty' is not a valid integer" in find("#errors").text, 60, "the error")
    assert not find("#launch").is_displayed()
    field("max_train_steps", "60")
    find("#check").click()
    wait(lambda: find("#launch").is_displayed(), 240, "the plan shown before launching")
    assert "Memory plan" in find("#plan").text
    find("#launch").click()
    wait(lambda: browser.execute_script("return location.hash") == "#/run/quick", 60, "the run's page")
    launched = json.loads((runs_dir / "quick" / "webui_launch.json").read_text())
    assert sorted(launched["overrides"]) == sorted(  # the edited keys only; text quoted, numbers as typed
        f'{k}={json.dumps(v) if "_dir" in k or "model" in k else v}' for k, v in edits.items())

    # -- the second run, through the API, while the first trains -----------------------------------
    long = {"pretrained_model_name_or_path": str(tiny_qwen_image), "data_config.img_dir": str(sample_data),
            "max_train_steps": "100000", "checkpointing_steps": "100000"}
    assert _post(f"{base}/api/runs", {"config": QUICKSTART, "form": long, "name": "long"}) == {"id": "long"}

    wait(lambda: step() > 0 and plotted() > 0, 240, "the step counter and the loss plot")
    first = (step(), plotted())
    wait(lambda: step() > first[0] and plotted() > first[1], 120, "the step counter and the loss plot updating")
    sample = '#samples .samples-row:not([data-step="0"]) img'
    wait(lambda: browser.execute_script(f"const i = document.querySelector('{sample}'); return i && i.complete && "
                                        "i.naturalWidth > 0"), 240, "a validation sample after training steps")
    wait(lambda: find("#state").text == "finished", 240, "the quick-start run finished")
    wait(lambda: find("#download").is_displayed(), 30, "the LoRA download link")
    lora = urllib.request.urlopen(find("#download").get_attribute("href")).read()
    assert lora == (runs_dir / "quick" / "pytorch_lora_weights.safetensors").read_bytes()
    assert find("#planned-peak").text.startswith("plan: GPU peak")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "webui_run.png"))

    # -- stop the second run with the page's button ----------------------------------------------
    browser.get(f"{base}/#/run/long")
    wait(lambda: find("#state").text == "running" and step() > 0, 240, "the long run training")
    wait(lambda: re.fullmatch(r"\d+(\.\d+)? (s|min|h)", find("#eta").text), 60, "its ETA from the metrics' times")
    find("#stop").click()
    wait(lambda: find("#state").text == "stopped", 120, "the long run stopped")
    wait(lambda: "checkpoint-" in find("#checkpoints").text, 30, "its checkpoint listed")
    assert (runs_dir / "long" / find("#checkpoints li").text / "trainer_state.json").is_file()

    browser.get(f"{base}/#/")
    wait(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")) == 2, 30, "both runs listed")
    states = {row.get_attribute("data-run"): row.find_element(By.CSS_SELECTOR, ".state").text
              for row in browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")}
    assert states == {"quick": "finished", "long": "stopped"}
    speeds = [float(cell.text) for cell in browser.find_elements(By.CSS_SELECTOR, "#runs tbody td:nth-child(8)")]
    assert len(speeds) == 2 and all(0 < s < 60 for s in speeds)  # s/step
    browser.save_screenshot(str(ARTIFACTS / "webui_runs.png"))
