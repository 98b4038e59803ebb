"""Qwen-Image-Edit(-2509/-2511): ``spec.py`` (facts, light) and ``model.py`` (the runtime family)."""
