"""together-train."""
