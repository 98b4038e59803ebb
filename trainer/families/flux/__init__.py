"""FLUX.1-dev: ``spec.py`` (facts, light) and ``model.py`` (the runtime family, imports diffusers)."""
