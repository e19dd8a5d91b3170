"""The HTTP port (`serve --http-port`): one route package per API (Tinker, Together RL, OpenAI), Prometheus
metrics and the dashboard, over the same service layer as gRPC; routes parse and shape, the service decides."""
