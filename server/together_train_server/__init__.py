"""together-train resource server: wire (gRPC servicers) -> service logic -> engines."""
