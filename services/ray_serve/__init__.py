"""u1serve on a Ray cluster (Ray Serve): the `[ray]` extra, `u1serve ray`, or `serve run` with
`services.ray_serve.app:app_builder`.

One Serve application of four deployments, the same services as `u1serve up`:
- `gateway` (the ingress): the gateway's own FastAPI app (services.gateway.app.create_app) behind Serve's HTTP
  proxy; it keeps talking HTTP to the engine replicas and routes over them with its own rules (prefix affinity for
  understanding; for generation the least loaded replica that can read the prefix's KV, its own node first);
- `understanding`, `generation`: each replica starts the real engine server as a child process on its node
  (its GPUs are the replica's Ray GPUs: a TP / CFG / SP group is one replica, so on one node), registers the URL,
  answers Serve's health checks from the process and reports the engine's own load signals (queue depth, KV
  pool use) to Serve's autoscaler (autoscale.py);
- `registry`: which engine replica listens where (heartbeats with a time to live), read by the gateway.

KV handoff: understanding runs the network transport (NIXL); a generation replica on the same node (the same
/dev/shm) reads a prefix through shared memory, one on another node over the network (shm_transfer).
"""
