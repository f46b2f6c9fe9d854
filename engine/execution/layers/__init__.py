"""Building blocks shared by target models and draft heads."""
