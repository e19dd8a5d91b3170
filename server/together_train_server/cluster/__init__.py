"""Model resources on a Ray cluster (``together-train cluster``, docs/cluster.md): the catalog, the actors,
the control plane and its routing gRPC port. Needs the ``cluster`` extra (Ray)."""
