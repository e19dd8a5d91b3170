"""Weight publishing: weights_sync, pushes after a load, adapters for scoring (`publishing`)."""
