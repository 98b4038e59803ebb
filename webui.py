"""A local web page to start, watch and stop training runs.

    python webui.py [--host 127.0.0.1] [--port 7860] [--runs-dir output] [--token T]

Binds to localhost by default. Any other host needs a token (``--token`` or ``WEBUI_TOKEN``), which
every request then carries: open ``http://HOST:PORT/?token=T`` once and the page keeps it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--runs-dir", default="output", help="folder whose run folders the page lists and starts")
    parser.add_argument("--token", default=os.environ.get("WEBUI_TOKEN"),
                        help="required by every request (default: $WEBUI_TOKEN); needed for a non-local --host")
    parser.add_argument("--accelerate-config", metavar="FILE",
                        help="accelerate config for the runs started here (default: one process, --cpu without a GPU)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.host not in LOCAL_HOSTS and not args.token:
        print(f"error: --host {args.host} is reachable from other machines; give --token (or set WEBUI_TOKEN)",
              file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent
    runs_dir = Path(args.runs_dir).resolve()
    os.chdir(root)  # relative paths in configs are read from the project root, as the runs read them
    import uvicorn

    from webui.launch import Launcher
    from webui.server import create_app

    runs_dir.mkdir(parents=True, exist_ok=True)
    local = args.host in LOCAL_HOSTS
    launcher = Launcher(["--config_file", str(Path(args.accelerate_config).resolve())]) if args.accelerate_config else None
    app = create_app(runs_dir, token=args.token, launcher=launcher,
                     allowed_hosts=[*LOCAL_HOSTS, "[::1]"] if local else None)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"web UI on http://{shown}:{args.port}/ serving {runs_dir}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
