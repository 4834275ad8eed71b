"""The naming and liveness rule of RL trajectory segments (shared_trajectory.py), with no torch import: the launcher
applies it after its services stopped, as a generation server does at its start and shutdown.

A segment is /dev/shm/<kv pool name>-rl-<pid>-<n>-<token>; while a live process uses it, it holds one of two locks
on it (shm_transfer.locks): the engine that made it the creator's slot, the HTTP process that maps it the holder's.
"""
from __future__ import annotations

import logging

from shm_transfer.segment import CREATOR_SLOT, SHM_DIR, reclaim_orphans

log = logging.getLogger("u1serve.generation.trajectory")

HOLDER_SLOT = 1            # the HTTP process's liveness lock; the engine's is CREATOR_SLOT
SLOTS = (CREATOR_SLOT, HOLDER_SLOT)


def segment_prefix(kv_pool_name: str) -> str:
    """Every trajectory segment of the servers on this KV pool starts with this (the stack's leak check sees it)."""
    return f"{kv_pool_name}-rl-"


def reclaim(kv_pool_name: str) -> list[str]:
    """Unlink the trajectory segments no live process holds (left by a killed server or engine); a live one's are
    never touched, whoever shares the prefix."""
    removed = reclaim_orphans(segment_prefix(kv_pool_name), SLOTS)
    if removed:
        log.warning("reclaimed %d RL trajectory segment(s) of dead processes in %s", len(removed), SHM_DIR)
    return removed
