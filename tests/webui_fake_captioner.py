"""Stands in for ``caption.py`` in the web page's tests (never imported by the project).

    python tests/webui_fake_captioner.py --data=DIR --json --model=M ...

Prints what ``caption.py --json`` prints, one line per image of DIR (sorted), one every
``FAKE_CAPTION_S`` seconds (default 0.1), then the summary line; writes no caption. Its first line on
stderr says whether it was given ``WEBUI_TOKEN`` (the page's secret, which no child should get).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    data = Path(next(a for a in sys.argv if a.startswith("--data=")).split("=", 1)[1])
    print(f"WEBUI_TOKEN {'given' if 'WEBUI_TOKEN' in os.environ else 'not given'}", file=sys.stderr, flush=True)
    period = float(os.environ.get("FAKE_CAPTION_S", "0.1"))
    images = sorted(p.name for p in data.iterdir() if p.suffix == ".png")
    for name in images:
        time.sleep(period)
        print(json.dumps({"image": name, "status": "captioned"}), flush=True)
    print(json.dumps({"summary": {"captioned": len(images), "skipped": 0, "failed": 0}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
