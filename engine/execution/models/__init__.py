"""Target models: `ModelSpec` (the architecture facts read from a transformers config) and the one
Llama-family `DecoderModel` that serves every supported family."""
