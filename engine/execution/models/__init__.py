"""Target model implementations and the registry that picks one for a checkpoint."""
