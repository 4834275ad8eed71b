"""Sequence parallelism: the image tokens of every CFG branch sharded over `sp` ranks.

Each SP rank holds a contiguous slice of every segment (one (job, branch, image) = N image tokens) of a
packed forward: rank r gets tokens [lo_r, hi_r) of each segment, sizes from `split(N, sp)` (exact, uneven
allowed, no padding rows). Everything in a decoder layer is per row except attention; the two modes
differ only there (`wrap_attend`):
- `ulysses`: one all-to-all over heads gives each rank every row for its 1/sp of the heads (q, k and v
  in one message), attention runs as without SP on those heads (the job's KV buffer holds only this
  rank's KV-head slice, prefix included), and a second all-to-all returns each rank's rows with all
  heads. sp must divide the q and KV head counts.
- `kv-gather`: one all-gather gives each rank the K and V rows of every rank (k|v in one message, all
  KV heads); each rank writes them into its job KV buffer (which holds every KV head) and attends its
  own query rows, all heads, against the whole K/V: no return trip. With GQA the message is smaller
  (8B, 32 q / 8 KV heads, SP2: 8.4 MB a layer against Ulysses' 21 MB), attention FLOPs per rank are
  the same, and any sp works.
After the final norm the hidden rows are gathered once per step, so the head, the velocities, CFG and
Euler run on whole images on every rank (identical states, no broadcast; the pixel head needs whole
rows anyway).

Received rows arrive rank-major ([rank 0's rows ; rank 1's rows ; ...]); `RowLayout` holds the index
that puts them in canonical (segment-major, token) order, and its inverse (None when the forward has a
single segment: then rank-major is canonical).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .config import SP_MODES

# one tensor out, every rank's equal-size input in rank order (newer torch calls it all_gather_single)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split(n: int, world: int) -> list[int]:
    """Rows of an n-row segment on each rank: the first n % world ranks hold one more."""
    q, rem = divmod(n, world)
    return [q + (r < rem) for r in range(world)]


def check_mode(mode: str) -> str:
    if mode not in SP_MODES:
        raise ValueError(f"sequence-parallel mode must be one of {', '.join(SP_MODES)}, got {mode!r}")
    return mode


def check_heads(num_heads: int, num_kv_heads: int, sp: int, mode: str = "ulysses") -> None:
    """Ulysses: each SP rank attends with whole heads, so sp must divide both head counts (ValueError
    naming the values that work). kv-gather keeps every head on every rank: any sp."""
    if check_mode(mode) == "kv-gather" and sp >= 1:
        return
    if sp >= 1 and num_heads % sp == 0 and num_kv_heads % sp == 0:
        return
    ok = [d for d in range(1, num_kv_heads + 1) if num_heads % d == 0 and num_kv_heads % d == 0]
    raise ValueError(f"sequence parallel {sp} must divide the model's {num_heads} attention heads and "
                     f"{num_kv_heads} KV heads (sizes this model takes: {', '.join(map(str, ok))})")


def bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of an n-row segment held by `rank`."""
    sizes = split(n, world)
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


class RowLayout:
    """Where the rows of one packed forward live: segments of `seg_lengths` rows in canonical order."""

    def __init__(self, seg_lengths: list[int], world: int, rank: int, device):
        self.world = world
        self.rank = rank
        per_seg = [split(n, world) for n in seg_lengths]
        self.counts = [sum(s[r] for s in per_seg) for r in range(world)]   # rows per rank
        self.local = self.counts[rank]
        self.total = sum(seg_lengths)
        self.recv_to_canon: torch.Tensor | None = None
        self.canon_to_recv: torch.Tensor | None = None
        self.gather_index: torch.Tensor | None = None   # canonical row -> row of the padded gather
        width = max(self.counts) if self.counts else 0
        single = len(seg_lengths) == 1
        if single and width * world == self.total:
            return                                     # rank-major == canonical, no padding
        # canonical row -> (rank, offset among that rank's rows); built on the device (no host copy)
        recv, padded = [], []
        starts = [sum(self.counts[:r]) for r in range(world)]
        seen = [0] * world
        for sizes in per_seg:
            for r, k in enumerate(sizes):
                if k:
                    recv.append((starts[r] + seen[r], k))
                    padded.append((r * width + seen[r], k))
                seen[r] += k

        def index(runs):
            return torch.cat([torch.arange(a, a + k, device=device) for a, k in runs])
        self.gather_index = index(padded)
        if not single:
            self.recv_to_canon = index(recv)
            self.canon_to_recv = torch.argsort(self.recv_to_canon)


class SeqParallel:
    """One rank's view of its SP group (ranks sharing the same CFG branches)."""

    def __init__(self, rank: int = 0, world: int = 1, group=None, ctrl_group=None, mode: str = "ulysses"):
        self.rank = rank
        self.world = world
        self.group = group            # tensors (NCCL on CUDA, gloo on CPU)
        self.ctrl_group = ctrl_group  # gloo: barriers between ranks
        self.mode = check_mode(mode)
        self._layouts: dict[tuple, RowLayout] = {}

    @classmethod
    def single(cls) -> "SeqParallel":
        return cls()

    def bounds(self, n: int) -> tuple[int, int]:
        return bounds(n, self.world, self.rank)

    def heads(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) slice of n attention (or KV) heads under Ulysses."""
        if n % self.world:
            raise ValueError(f"sequence parallel {self.world} must divide the head count {n}")
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def kv_heads(self, n: int) -> tuple[int, int]:
        """The [lo, hi) of the model's n KV heads this rank's job buffers hold (kv-gather: all)."""
        return (0, n) if self.mode == "kv-gather" else self.heads(n)

    @property
    def local_queries(self) -> bool:
        """Whether attention gets this rank's query rows (no SP, kv-gather) rather than every row of
        a head slice (Ulysses)."""
        return self.world == 1 or self.mode == "kv-gather"

    def layout(self, seg_lengths: list[int], device) -> RowLayout:
        """The layout of a forward (kept: a steady batch has the same segments step after step)."""
        key = (tuple(seg_lengths), str(device))
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 32:
                self._layouts.clear()
            lay = self._layouts[key] = RowLayout(seg_lengths, self.world, self.rank, device)
        return lay

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.ctrl_group)

    # -- attention -------------------------------------------------------------------------------
    def wrap_attend(self, layout: RowLayout, attend):
        """The layers' attend (local rows, all heads in and out) around the engine's `attend`, which
        takes k / v of every row in canonical order and, Ulysses, q of every row for this rank's heads
        (kv-gather: q of the local rows, all heads)."""
        if self.world == 1:
            return attend
        if self.mode == "kv-gather":
            def kv_attend(layer: int, q, k, v):
                return attend(layer, q, *self._gather_kv(layout, k, v))
            return kv_attend

        def sp_attend(layer: int, q, k, v):
            qc, kc, vc = self._to_heads(layout, q, k, v)
            return self._to_rows(layout, attend(layer, qc, kc, vc), q.shape)
        return sp_attend

    def _gather_kv(self, layout: RowLayout, k, v):
        """Local k, v [T, Hkv, D] -> every rank's rows in canonical order, one all-gather (k|v per row)."""
        T = k.shape[0]
        send = k.new_empty((max(layout.counts), 2) + tuple(k.shape[1:]))
        send[:T, 0].copy_(k)
        send[:T, 1].copy_(v)
        send[T:].zero_()                 # rows past T pad an uneven split; dropped by the gather index
        kv = self._gather_padded(layout, send)
        return kv[:, 0], kv[:, 1]        # row-strided views: kv_write_ takes them as they are

    def _to_heads(self, layout: RowLayout, q, k, v):
        W, T = self.world, q.shape[0]
        hq, hk, D = q.shape[1] // W, k.shape[1] // W, q.shape[2]
        # per destination rank: its head slice of q, k, v for every local row, one message (one copy)
        a, b = hq * D, (hq + hk) * D
        width = b + hk * D
        send = q.new_empty((W, T, width))
        send[:, :, :a].copy_(q.reshape(T, W, a).transpose(0, 1))
        send[:, :, a:b].copy_(k.reshape(T, W, b - a).transpose(0, 1))
        send[:, :, b:].copy_(v.reshape(T, W, b - a).transpose(0, 1))
        recv = send.new_empty((layout.total, width))
        dist.all_to_all_single(recv, send.view(W * T, width), output_split_sizes=layout.counts,
                               input_split_sizes=[T] * W, group=self.group)
        if layout.recv_to_canon is not None:
            recv = recv.index_select(0, layout.recv_to_canon)
        return recv[:, :a].view(-1, hq, D), recv[:, a:b].view(-1, hk, D), recv[:, b:].view(-1, hk, D)

    def _to_rows(self, layout: RowLayout, out, q_shape):
        W = self.world
        T, Hq, D = q_shape
        flat = out.reshape(layout.total, -1)
        if layout.canon_to_recv is not None:
            flat = flat.index_select(0, layout.canon_to_recv)
        recv = flat.new_empty((W * T, flat.shape[1]))
        dist.all_to_all_single(recv, flat.contiguous(), output_split_sizes=[T] * W,
                               input_split_sizes=layout.counts, group=self.group)
        return recv.view(W, T, Hq // W, D).transpose(0, 1).reshape(T, Hq, D)

    # -- whole rows --------------------------------------------------------------------------------
    def gather_rows(self, layout: RowLayout, x: torch.Tensor) -> torch.Tensor:
        """Local rows [layout.local, ...] -> every rank's rows in canonical order [layout.total, ...]."""
        if self.world == 1:
            return x
        width = max(layout.counts)
        if x.shape[0] < width:
            x = torch.cat([x, x.new_zeros((width - x.shape[0],) + x.shape[1:])])
        return self._gather_padded(layout, x.contiguous())

    def _gather_padded(self, layout: RowLayout, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's rows padded to the widest rank's count -> all rows, canonical order."""
        out = x.new_empty((self.world * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x, group=self.group)
        return out if layout.gather_index is None else out.index_select(0, layout.gather_index)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the SP ranks, added in rank order (bit-identical on every rank)."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out
