"""Krea 2 (Raw and Turbo): see spec.py for its facts, model.py for the runtime."""
