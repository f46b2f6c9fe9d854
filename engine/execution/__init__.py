"""Model execution: loading weights, the decoder models and their layers, the runner that batches
a step's tokens into forward passes, the CPU/CUDA kernels they call, and what passes cost."""
