"""FLUX.1-dev: ``spec.py`` (facts, light) and ``family.py`` (the runtime family, imports diffusers)."""
