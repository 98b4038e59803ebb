"""What a run keeps on disk, and how it survives a crash, a stop or a full disk.

- ``run_dir.py``: the output folder: fresh, resume or overwrite; run_status.json, config.yaml, final names;
- ``run_lock.py``: one run per output folder (``run.lock``);
- ``checkpoint.py``: atomic LoRA files and checkpoint folders, finding and pruning them;
- ``checkpointer.py``: the run's state: every part a checkpoint saves and a resume restores (one table),
  and which checkpoint a resume starts from;
- ``resume_check.py``: what a checkpoint records of its run, and what a resume may change;
- ``position.py``: where the loop stands (epoch, micro-batch), so a resume skips exactly what was trained;
- ``disk_full.py``: out of space, whichever library hit it, as one clear error.

Nothing is imported here: import the module you need (``from trainer.run_folder import checkpoint``).
"""
