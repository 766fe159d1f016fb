"""Model adapters implementing ``coolsd.protocols.ARModel`` and their shared KV cache."""
