"""Real targets assembled from local checkpoint files (one module per model family)."""
