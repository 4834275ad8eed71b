"""`u1serve` and the launcher: the command line, the stack plan (engines, gateway, GPUs, MPS, QoS) and the
supervisor that starts and stops its processes."""
