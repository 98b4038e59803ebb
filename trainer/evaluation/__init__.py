"""How good the trained weights are while they train (``validation`` and ``evaluation`` sections).

- ``validation.py``: sample images during training with the family's own pipeline;
- ``held_out.py``: the held-out loss, over-fitting detection, the checkpoint to keep (``keep_best``);
- ``image_metrics.py``: optional DINOv2 / CLIP scores of the validation samples.

``python -m trainer.judge RUN_DIR`` (``trainer/judge.py``) ranks a finished run's checkpoints with these.
Nothing is imported here: import the module you need (``from trainer.evaluation.held_out import ...``).
"""
