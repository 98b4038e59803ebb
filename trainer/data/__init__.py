"""The engine's side of data (folders, buckets and the cache's storage live in ``image_datasets/``).

- ``data_mix.py``: the run's datasets, each scanned with its own settings, and the sampler that mixes them;
- ``features.py``: the embedding cache: entry keys, the cache pass, the reads that feed the step.

Nothing is imported here: import the module you need (``from trainer.data.features import ...``).
"""
