"""together-train cookbook: codecs, sample builders, recipes."""
