"""Checkpoints: the store on disk (`store`), the SQLite registry (`registry`), and the resource's
checkpoint operations (`ops`)."""
