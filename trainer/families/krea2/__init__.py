"""Krea 2 (Raw and Turbo): see spec.py for its facts, family.py for the runtime."""
