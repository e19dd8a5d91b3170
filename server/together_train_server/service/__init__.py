"""Service logic of the resource, between the wire and the engines: sessions and their owners, the per-session
operation queue, validation, policy versions and weight publishing, the replica pool, checkpoints and the registry,
inference for the HTTP APIs, telemetry. Imports no gRPC or generated protobuf code."""
