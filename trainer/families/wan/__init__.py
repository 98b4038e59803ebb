"""Wan 2.1 / 2.2 video: ``spec.py`` (facts, light) and ``family.py`` (the runtime family, imports diffusers)."""
