"""Qwen-Image-2.1: see spec.py for its facts, family.py for the runtime."""
