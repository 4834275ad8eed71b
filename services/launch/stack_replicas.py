"""`u1serve up --und-replicas N --gen-replicas M`: the one-replica stack's services, replicated on this host.

Understanding replica i: its own port, GPUs (the i-th group of --und-tp ids in --und-gpus) and KV pool
(`<pool>-i`; replica 0 keeps the stack's pool name). Generation replica j: its own port and GPUs; it attaches the
pool of understanding replica j % N and reads the other pools of the host as well (one host: every prefix moves
through shared memory). The gateway gets every replica's URL and routes over them (services/gateway/routing.py).
Names: und, und1, ..., gen, gen1, ... (one replica keeps the plain names)."""
from __future__ import annotations

import dataclasses

from services.launch.launcher import port_free
from services.base.netutil import free_port


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _ports(first: int, n: int, taken: set[int], probe: bool) -> list[int]:
    """first, first+1, ... (a free port instead of one that is taken)."""
    out = [first]
    for i in range(1, n):
        port = first + i
        if port in taken or (probe and not port_free("127.0.0.1", port)):
            port = free_port()
        taken.add(port)
        out.append(port)
    return out


def _gpu_groups(kind: str, gpus: list[str], size: int, n: int) -> list[list[str]]:
    if not gpus:                       # CPU
        return [[] for _ in range(n)]
    if len(gpus) < size * n:
        flag = "--und-gpus" if kind == "und" else "--gen-gpus"
        raise SystemExit(f"{n} {kind} replicas of {size} GPU(s) need {size * n} GPU ids in {flag}, got {gpus}")
    return [gpus[i * size:(i + 1) * size] for i in range(n)]


def replicate(specs: list, args, ctx: dict, probe: bool = True) -> tuple[list, list[str]]:
    """(the specs with und / gen replicated and the gateway pointed at all of them, the KV pool names)."""
    n, m = args.und_replicas, args.gen_replicas
    if n < 1 or m < 1:
        raise SystemExit("--und-replicas and --gen-replicas must be >= 1")
    pool = ctx["pool"]
    if n == m == 1:
        return specs, [pool]
    by_name = {s.name: s for s in specs}
    und, gen, gateway = by_name["und"], by_name["gen"], by_name["gateway"]
    pl = ctx["placement"]
    taken = {args.port, args.und_port, args.gen_port}
    pools = [pool] + [f"{pool}-{i}" for i in range(1, n)]
    und_gpus = _gpu_groups("und", pl.und_gpus, args.und_tp, n)
    gen_gpus = _gpu_groups("gen", pl.gen_gpus, pl.gen_world, m)
    out, urls = [], {"--und-url": [], "--gen-url": []}
    for kind, spec, count, groups, flag in (("und", und, n, und_gpus, "--und-url"),
                                            ("gen", gen, m, gen_gpus, "--gen-url")):
        first = args.und_port if kind == "und" else args.gen_port
        for i, port in enumerate(_ports(first, count, taken, probe)):
            argv = _with(_with(spec.argv, "--port", str(port)), "--kv-pool-name", pools[i % n])
            env = dict(spec.env, **({"CUDA_VISIBLE_DEVICES": ",".join(groups[i])} if groups[i] else {}))
            out.append(dataclasses.replace(spec, name=kind if i == 0 else f"{kind}{i}", argv=argv, env=env,
                                           health_url=f"http://127.0.0.1:{port}/health"))
            urls[flag].append(f"http://127.0.0.1:{port}")
    argv = list(gateway.argv)
    for flag, values in urls.items():
        at = argv.index(flag)
        del argv[at:at + 2]
        for url in reversed(values):
            argv[at:at] = [flag, url]
    out.append(dataclasses.replace(gateway, argv=argv))
    return out, pools
