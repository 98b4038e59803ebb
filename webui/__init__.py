"""A local web page onto the run folders: list runs, watch one live, start, stop and resume runs.

The page is a window onto the same things as the command line, never a second engine: runs are
started as ``accelerate launch <entry script> --config ...`` child processes, configs are checked by
``trainer.config.load_config`` (the CLI's own errors), and everything shown is read from the run
folders the engine writes (``trainer/run_dir.py``).

    paths.py    the only way a request names a file: inside --runs-dir or train_configs/, nowhere else
    runs.py     what a run folder holds (status, metrics, samples, checkpoints, log tail)
    schema.py   the form: TrainConfig's fields as JSON, and a YAML's values for them
    launch.py   entry scripts, config checks, --plan, and the child processes (start, stop, resume)
    server.py   the FastAPI app: JSON API, server-sent events, the static page
"""
