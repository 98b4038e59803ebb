"""Wan 2.1 / 2.2 video: ``spec.py`` (facts, light) and ``model.py`` (the runtime family, imports diffusers)."""
