"""The engine layer: decoding, the one loop, drafting, methods, the model protocol."""
