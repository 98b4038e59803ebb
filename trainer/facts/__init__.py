"""The ground floor of ``trainer/``: facts that need neither torch nor a config to state.

- ``optimizer_choices.py``: each ``optimizer:`` value's facts (package, pip line, kind, state bytes), the table
  the config checks, the optimizer builder and the memory planner read;
- ``quantization_formats.py``: the weight formats each quantization backend offers, and ``QuantizationChoice``;
- ``family_spec.py``: the fields of a family's spec (``FamilySpec``, its block groups, text tokens, LoRA presets).

Each family's own facts live in its package (``trainer/families/<name>/spec.py``, the registry
``trainer.families.SPECS``) and sit on this floor too: ``tests/test_layers.py`` (``TRAINER_FLOORS``) holds every
module of this floor to importing nothing above it, and none of them imports torch.

Nothing is imported here: import the module you need (``from trainer.facts.optimizer_choices import ...``).
"""
