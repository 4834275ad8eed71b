"""The service kit: what the gateway and both engines' HTTP processes share (errors, SSE, JSON bodies, the
request middleware, disconnect watching, process ties, restart policy, admission). Engine-free."""
