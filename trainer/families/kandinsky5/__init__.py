"""Kandinsky 5 image: ``spec.py`` (facts, light) and ``family.py`` (the runtime family, imports diffusers)."""
