"""The shared training engine: one loop for every model family."""
