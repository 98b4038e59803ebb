"""Qwen-Image-Edit(-2509/-2511): ``spec.py`` (facts, light) and ``family.py`` (the runtime family)."""
