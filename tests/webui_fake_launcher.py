"""Stands in for ``accelerate launch`` in the web page's stop test (never imported by the project).

    python tests/webui_fake_launcher.py <entry> --config FILE ... output_dir=DIR

Like accelerate's simple launcher it starts the "trainer" as its child, waits, and exits 1 when the
child failed, without forwarding signals. The child logs one metrics line per 0.05 s; on SIGTERM it
writes a complete checkpoint (``trainer_state.json``) and exits 143, as ``trainer/signals.py`` does.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r'''
import json, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
step = 0
def stop(signum, frame):
    folder = out / f"checkpoint-{step}"; folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "files": {}}))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
with open(out / "metrics.jsonl", "a") as fh:
    while True:
        step += 1
        fh.write(json.dumps({"step": step, "loss": 1.0 / step, "lr": 1e-4, "time": time.time()}) + "\n"); fh.flush()
        time.sleep(0.05)
'''

if __name__ == "__main__":
    output_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
    code = subprocess.call([sys.executable, "-c", CHILD, output_dir])
    sys.exit(1 if code else 0)
