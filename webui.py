"""A local web page to start, queue, watch, stop, resume and delete training runs.

    python webui.py [--host 127.0.0.1] [--port 7860] [--runs-dir output] [--max-concurrent N]
                    [--cache-root DIR] [--token-file FILE] [--accelerate-config FILE]

Binds to localhost by default. Any other host needs a token (``WEBUI_TOKEN``, ``--token-file``, or
``--token``, which other users of the machine can see in ``ps``): open ``http://HOST:PORT/?token=T``
once; the page swaps it for a cookie and takes it out of the address bar. Ctrl-C stops the server
(within seconds, even with pages open); the runs it started go on, and a restarted server shows them.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from pathlib import Path
from typing import IO, Any, List, Optional

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_GRACE_S = 2  # then uvicorn closes what is still open
LOCK_NAME = ".webui.lock"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on (default: 7860)")
    parser.add_argument("--runs-dir", default="output",
                        help="folder whose run folders the page lists and starts (default: output)")
    parser.add_argument("--max-concurrent", type=int, metavar="N",
                        help="runs started here that run at once; the others wait as queued (default: one per "
                             "GPU for one-process runs, else one)")
    parser.add_argument("--cache-root", metavar="DIR",
                        help="a folder outside --runs-dir that a run's cache_dir may name (e.g. a shared cache)")
    parser.add_argument("--token", default=os.environ.get("WEBUI_TOKEN"),
                        help="required by every request (default: $WEBUI_TOKEN); needed for a non-local --host")
    parser.add_argument("--token-file", metavar="FILE", help="read the token from this file (not shown in ps)")
    parser.add_argument("--accelerate-config", metavar="FILE",
                        help="accelerate config for the runs started here (default: one process, the config's "
                             "mixed_precision; --cpu with one CPU thread without a GPU)")
    return parser.parse_args(argv)


def _token(args: argparse.Namespace) -> Optional[str]:
    if args.token_file:
        return Path(args.token_file).read_text().strip() or None
    return args.token or None


def _hold_runs_dir(runs_dir: Path) -> Optional[IO[str]]:
    """One page per runs folder (two would both start its queued runs): an exclusive lock on
    ``.webui.lock`` there for as long as this process lives; None when another page holds it."""
    handle = open(runs_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        token = _token(args)
    except OSError as exc:
        print(f"error: --token-file {args.token_file}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.host not in LOCAL_HOSTS and not token:
        print(f"error: --host {args.host} is reachable from other machines; set WEBUI_TOKEN (or give --token-file)",
              file=sys.stderr)
        return 2
    if args.max_concurrent is not None and args.max_concurrent < 1:
        print(f"error: --max-concurrent {args.max_concurrent} must be at least 1", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent
    runs_dir = Path(args.runs_dir).resolve()
    cache_root = Path(args.cache_root).resolve() if args.cache_root else None
    os.chdir(root)  # relative paths in configs are read from the project root, as the runs read them
    runs_dir.mkdir(parents=True, exist_ok=True)
    held = _hold_runs_dir(runs_dir)
    if held is None:
        print(f"error: another web page serves {runs_dir} (see {runs_dir / LOCK_NAME}); stop it or give another "
              "--runs-dir", file=sys.stderr)
        return 2
    import uvicorn

    from webui.runner import Launcher
    from webui.scheduler import visible_gpus
    from webui.server import create_app

    custom = bool(args.accelerate_config)
    launcher = Launcher(["--config_file", str(Path(args.accelerate_config).resolve())]) if custom else Launcher()
    devices = [] if custom else visible_gpus()  # a one-process run takes one GPU; a config's run takes all
    local = args.host in LOCAL_HOSTS
    app = create_app(runs_dir, token=token, launcher=launcher, allowed_hosts=[*LOCAL_HOSTS, "[::1]"] if local else None,
                     max_concurrent=args.max_concurrent or max(1, len(devices)), devices=devices, cache_root=cache_root)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"web UI on http://{shown}:{args.port}/ serving {runs_dir}"
          + (" (open it once with ?token=<your token>)" if token else ""), flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        _server(config, app.state.closing).run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it held once it has shut down
        pass
    print("web UI stopped; runs it started go on (a new `python webui.py` shows them)", flush=True)
    return 0


def _server(config: Any, closing: Any) -> Any:
    """uvicorn's server, telling the app when a stop begins: its event streams (open pages) end at
    once instead of holding the shutdown open."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            closing.set()
            super().handle_exit(sig, frame)

    return Server(config)


if __name__ == "__main__":
    sys.exit(main())
