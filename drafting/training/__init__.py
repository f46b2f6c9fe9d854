"""Head training: conversations and self-distilled answers, target features, the objective, the
resumable trainer behind `aerie train-head`."""
