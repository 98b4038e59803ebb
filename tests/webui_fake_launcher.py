"""Stands in for ``python -m trainer.launch`` in the web page's tests (never imported by the project).

    python tests/webui_fake_launcher.py <entry> --config FILE ... max_train_steps=N output_dir=DIR

Like ``trainer.launch`` it starts the "trainer" as its child in its own process group, passes
SIGTERM/SIGINT on to it once, and exits with its code. The child writes what the real trainer
writes, in the same order: after ``FAKE_STARTUP_S`` (loading models) ``run.lock`` (flocked) and
``run_status.json`` ("running"), then one metrics line per ``FAKE_STEP_S`` and a checkpoint every
checkpointing_steps. On SIGTERM it writes a
complete checkpoint and "stopped" and exits 143 (``trainer/signals.py``); at max_train_steps it
writes the final checkpoint, the LoRA, ``summary.json`` and "finished" and exits 0. It resumes from
its latest checkpoint with ``resume_from_checkpoint=latest``, and records its environment's
``CUDA_VISIBLE_DEVICES``, ``WEBUI_TOKEN`` and ``HOME`` in ``fake_env.json``.
"""

from __future__ import annotations

import signal
import subprocess
import sys

CHILD = r'''
import json, os, signal, socket, sys, time
from pathlib import Path
out, max_steps, resume, every = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "latest", int(sys.argv[4])
startup, period = float(os.environ.get("FAKE_STARTUP_S", "0.3")), float(os.environ.get("FAKE_STEP_S", "0.05"))
out.mkdir(parents=True, exist_ok=True)
shown = ("CUDA_VISIBLE_DEVICES", "WEBUI_TOKEN", "HOME")
(out / ".e.tmp").write_text(json.dumps({k: os.environ.get(k) for k in shown}))
os.replace(out / ".e.tmp", out / "fake_env.json")  # whole, as a test reads it the moment it exists
def status(state, step, message):
    (out / ".s.tmp").write_text(json.dumps({"state": state, "step": step, "max_steps": max_steps,
                                             "message": message, "time": time.time()}))
    os.replace(out / ".s.tmp", out / "run_status.json")
def save(step):
    folder = out / f"checkpoint-{step}"
    folder.mkdir(exist_ok=True)
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"lora at %d" % step)
    (folder / "optimizer.bin").write_bytes(b"state")
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "global_step": step, "files": {}}))
step = 0
if resume:
    done = sorted(int(p.name[11:]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file())
    step = done[-1] if done else 0
def stop(signum, frame):
    save(step); status("stopped", step, "stopped by a signal"); (out / "run.lock").unlink(missing_ok=True)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
time.sleep(startup)
(out / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
import fcntl
lock_fd = os.open(out / "run.lock", os.O_RDONLY)
fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held while it runs, as trainer/run_folder/run_lock.py's owner holds it
status("running", step, "started")
with open(out / "metrics.jsonl", "a") as fh:
    while step < max_steps:
        step += 1
        fh.write(json.dumps({"step": step, "loss": 1.0 / step, "lr": 1e-4, "time": time.time()}) + "\n"); fh.flush()
        if step % every == 0 and step < max_steps:
            save(step)
        time.sleep(period)
save(step)
(out / "pytorch_lora_weights.safetensors").write_bytes(b"final lora")
(out / "summary.json").write_text(json.dumps({"family": "qwen_image", "outputs": {}}))
status("finished", step, "done")
(out / "run.lock").unlink(missing_ok=True)
'''


def _arg(name: str, default: str) -> str:
    """An override's value, else the YAML's (``--config``), else ``default``."""
    import yaml

    found = [a.split("=", 1)[1] for a in sys.argv if a.startswith(f"{name}=")]
    if found:
        return str(yaml.safe_load(found[-1]))  # a value as the CLI reads it (output_dir="..." is quoted)

    config = sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else None
    data = yaml.safe_load(open(config)) if config else {}
    return str(data.get(name, default)) if isinstance(data, dict) and data.get(name) is not None else default


if __name__ == "__main__":
    # The handlers first, as trainer.launch installs its own before it starts the trainer: a stop that comes while
    # the child is being started reaches it once it is there (installed after, the default action ended this
    # process and left the child running on its own, 100000 steps long).
    child = None
    forwarded, early = [], []  # the signal passed on (once), and one that came before the child was there

    def forward(signum: int, frame: object) -> None:
        if not forwarded:
            forwarded.append(signum)
            if child is not None:
                child.send_signal(signum)
            else:
                early.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    child = subprocess.Popen([sys.executable, "-c", CHILD, _arg("output_dir", "out"),
                              _arg("max_train_steps", "100000"), _arg("resume_from_checkpoint", ""),
                              _arg("checkpointing_steps", "100000")],
                             process_group=0)
    if early:
        child.send_signal(early[0])
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)
