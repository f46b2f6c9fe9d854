"""torch.compile of the target model, for `enable_torch_compile`.

Eager PyTorch dispatches some 25 small kernels per decoder layer, and on a CPU their overhead is a
good part of a decode step; the BLAS kernels themselves run far below peak for a few rows. Inductor
fuses the element-wise work into generated C++ loops, and with `freezing` it treats the weights as
constants and pre-packs them for the matmul library. Shapes are dynamic: the number of tokens, of
sequences and of cached entries changes every step, so one graph serves them all, except that
PyTorch specialises a size of exactly 1. `warm_up` compiles those variants at start-up, so that no
request waits for the compiler. Compiling needs a C++ compiler on CPU and takes a minute or two
per variant on a small machine (PyTorch caches the results on disk for later starts).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

# (tokens in the pass, tokens per sequence) of the shape variants PyTorch compiles apart: one or
# many sequences, each with one or many new tokens.
WARM_UP_SHAPES = ((1, 1), (4, 4), (2, 1), (8, 4))


def compile_model(model: nn.Module) -> nn.Module:
    """`model` compiled by inductor, its weights frozen into the graph."""
    return torch.compile(model, dynamic=True, options={"freezing": True})


def warm_up(runner) -> None:
    """Compile every shape variant now, with verify-shaped passes over junk tokens."""
    logger.info("torch.compile: compiling %d shape variants of the model", len(WARM_UP_SHAPES))
    started = time.perf_counter()
    for num_tokens, tokens_per_sequence in WARM_UP_SHAPES:
        runner.synthetic_pass(num_tokens, tokens_per_sequence)
    logger.info("torch.compile: done in %.0f s", time.perf_counter() - started)
