"""A local web page onto the run folders: list runs, watch one live, start, queue, stop, resume,
clone and delete runs, browse samples and checkpoints, edit the dataset's captions or caption a folder.

The page is a window onto the same things as the command line, never a second engine: runs are
started as ``python -m trainer.launch <entry script> --config ...`` child processes, configs are
checked by ``trainer.config.load_config`` (the CLI's own errors), and everything shown is read from
the run folders the engine writes (``trainer/run_folder/run_dir.py``). docs/WEBUI.md is the user's side.

    paths.py      the only way a request names a file: inside --runs-dir or train_configs/, nowhere else
    guard.py      every request first: other sites refused, body size, the token and its cookie
    rules.py      what a config from the page may do beyond the CLI's checks (no ${...}, where it writes)
    runs.py       what a run folder holds (state, metrics, samples, checkpoints, log tail)
    schema.py     the form: TrainConfig's fields as JSON with their help, and a YAML's values for them
    children.py   what every child process gets (its environment, without the page's token) and its record
    runner.py     entry scripts, config checks, --plan, the launch record, and the child processes
    scheduler.py  which run runs when: folder names, the queue, cancel, delete
    dataset.py    a run's images and captions, and saving a caption
    captioning.py "Caption this folder": caption.py as a child process, its state from its files
    server.py     the FastAPI app; api_runs.py, api_start.py, api_dataset.py its routes; deps.py shared
"""
