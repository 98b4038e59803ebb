"""Z-Image: ``spec.py`` (facts, light) and ``model.py`` (the runtime family, imports diffusers)."""
