"""EAGLE speculative decoding: the draft head, the dynamic draft tree, and lossless acceptance."""
