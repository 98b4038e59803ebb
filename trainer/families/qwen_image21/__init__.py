"""Qwen-Image-2.1: see spec.py for its facts, model.py for the runtime."""
