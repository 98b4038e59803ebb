"""Training data: image folders, captions, size grouping and the embedding cache."""
