"""coolsd: speculative decoding of autoregressive image generators."""
