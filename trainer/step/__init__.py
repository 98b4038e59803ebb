"""One optimizer step: its maths, its optimizer, and what keeps it free of host syncs.

- ``training_step.py``: tensors in, loss out (seeds, noise levels, forward, loss), shared with the GPU harness;
- ``flow_matching.py``: rectified-flow maths: timestep sampling and shifts, noising, target, loss weights;
- ``async_step.py``: non-blocking input copies, the NaN guard on the device, numbers read a step late;
- ``optimizer_step.py``: after the loss: backward, clipping, the guarded optimizer step (the engine's and the GPU
  harness's, written once);
- ``optim.py``: the optimizers, schedule-free evaluation weights, learning-rate schedules;
- ``optimizer_specs.py``: the old import path of each ``optimizer:`` choice's facts, now on the ground floor
  (``trainer/facts/optimizer_choices.py``).

Nothing is imported here: import the module you need (``from trainer.step.optim import ...``).
"""
