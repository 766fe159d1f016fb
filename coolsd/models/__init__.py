"""Model adapters implementing ``coolsd.engine.model_protocol.ARModel`` and their shared KV cache."""
