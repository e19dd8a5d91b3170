"""Short, runnable examples of the cookbook's interfaces."""
