"""FLUX.2 ([klein] 4B/9B base and [dev]): ``spec.py`` (facts, light) and ``family.py`` (the runtime family)."""
