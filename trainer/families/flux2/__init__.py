"""FLUX.2 ([klein] 4B/9B base and [dev]): ``spec.py`` (facts, light) and ``model.py`` (the runtime family)."""
