"""Shared helpers of every layer: errors, input loading, records and files, statistics."""
