"""The fused colocate mode (`u1serve up --mode colocate --colocate-engines fused`): both engines in ONE process on one
device. The understanding and generation servers keep their apps, ports, contracts and schedulers; their engine loops
run as threads of this process (each on its own CUDA stream: understanding high priority, generation low), so they
share one CUDA context. This package is the one place allowed to import both services (docs/architecture.md, "Fused
colocate"); the two services still never import each other."""
