"""Usage metering per session and per API key, kept in the resource's SQLite registry (docs/operating.md)."""
