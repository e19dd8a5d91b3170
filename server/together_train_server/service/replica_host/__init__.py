"""A generator replica's adapters as a service: versions, LRU residency, per-session locks (`host.ReplicaHost`,
`residency.AdapterResidency`); no gRPC: the replica's servicer translates its messages to these calls."""
