"""The decoding engine: trees, sampling, acceptance rules, verification."""
