"""Kandinsky 5 image: ``spec.py`` (facts, light) and ``model.py`` (the runtime family, imports diffusers)."""
