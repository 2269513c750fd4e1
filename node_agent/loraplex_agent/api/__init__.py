"""The agent's HTTP surface: the OpenAI-compatible server, its request and response bodies, the
serving functions behind the routes, token ids to text, and the Prometheus metrics."""
