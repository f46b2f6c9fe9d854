"""Turning logits into tokens and tokens into text: parameters, logits processors, the sampler,
the detokenizer."""
