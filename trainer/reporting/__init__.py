"""What a run tells the user as it goes and when it ends.

- ``tracking.py``: the console and ``train.log`` (loguru); which experiment trackers are installed;
- ``metric_logging.py``: one record per logged step, for ``metrics.jsonl`` and every tracker;
- ``dataset_losses.py``: each dataset's loss in a step (``loss/<name>``) and regularisation's weight;
- ``memory_check.py``: before anything loads, the memory planner's verdict for this run on this card;
- ``summary.py``: end-of-run reports: ``summary.json``, the loss curve, the timestep histogram, times.

Nothing is imported here: import the module you need (``from trainer.reporting.summary import ...``).
"""
