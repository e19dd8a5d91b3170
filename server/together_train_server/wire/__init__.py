"""The wire layer: gRPC servicers (thin: messages <-> service calls), the replica client, weight pushes,
authentication and TLS, the server builder; `wire.http` holds the HTTP APIs. No math here."""
