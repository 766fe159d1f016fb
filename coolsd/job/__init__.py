"""The job layer: the one generation job, its config schema, shards, summary, tracking."""
