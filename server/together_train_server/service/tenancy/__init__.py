"""Many tenants on one resource: the scheduler choice and per-API-key quotas (docs/design.md §5)."""
