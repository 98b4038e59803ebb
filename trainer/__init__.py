"""The shared training engine: one loop for every model family.

- ``engine.py``: the recipe (setup -> data + cache pass -> model -> loop -> finish);
- ``assembly.py``: how a run is put together from its config (accelerator, dtypes, data, model with its
  adapters, optimizer with its parameter groups, schedule), shared by the engine, the judge and the GPU harness;
- ``cli.py``, ``launch.py``, ``judge.py``: the commands (entry scripts' ``--config``, ``python -m
  trainer.launch``, ``python -m trainer.judge``); ``planner/``: ``python -m trainer.planner``;
- ``distributed.py``, ``signals.py``, ``platform.py``, ``precision.py``: what applies to the whole process;
- ``facts/``: the ground floor, torch-free facts (the optimizer table, the quantization formats; the
  families' specs sit on it too); ``quantization/``: frozen weights in fewer bits;
- ``config/``: the typed config; ``families/``: one package per model family;
- ``run_folder/``: what a run keeps on disk and how it survives; ``model/``: the loaded model made
  ready to train; ``step/``: one optimizer step; ``data/``: the engine's side of data;
  ``reporting/``: what a run tells the user; ``evaluation/``: samples and the held-out loss.

The sub-packages are floors: ``tests/test_layers.py`` (``TRAINER_FLOORS``) declares their order, and no
import runs back up it.
"""

import utils.quiet  # noqa: F401  (first: it silences known-harmless third-party warnings before they load)
