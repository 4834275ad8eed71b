"""Radix prefix cache over token keys -> KV slot ids (shared across requests).

Keys are token ids, except image-context tokens, whose keys come from a 128-bit hash of the image's pixel
values (see `image_keys`), so identical images hit the cache. A request with a `cache_salt` has its first key
paired with the salt's hash (`salt_keys`), so requests of different salts never share a node while requests
of one salt (or of none: the shared default domain) share as before. Nodes are ref-counted by the requests that use
them; only unreferenced leaves are evicted, least recently used first.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
from typing import Callable, Optional

import torch

_clock = itertools.count()


def image_digest(pixel_values: torch.Tensor, grid_hw) -> int:
    """A 128-bit content hash of one preprocessed image (pixel values + grid)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(int(g) for g in grid_hw)).encode())
    h.update(str(pixel_values.dtype).encode())
    h.update(pixel_values.detach().contiguous().cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def image_keys(digest: int, n: int) -> list[int]:
    """Cache keys for the n context tokens of one image: negative, so they never collide with token ids."""
    base = (digest << 24)
    return [-(1 + base + i) for i in range(n)]


def salt_keys(keys: list, salt: Optional[str]) -> list:
    """Keys in the isolation domain of `salt`: the first key becomes (salt hash, key), which no unsalted key
    or key of another salt equals, so the domains share no radix node."""
    if not salt or not keys:
        return keys
    digest = int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=16).digest(), "little")
    return [(digest, keys[0])] + keys[1:]


class Node:
    __slots__ = ("key", "value", "children", "parent", "ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["Node"]):
        self.key = key
        self.value = value
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = next(_clock)


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], enabled: bool = True):
        self.root = Node([], torch.empty(0, dtype=torch.int64), None)
        self.root.ref = 1  # never evicted
        self._free_slots = free_slots
        self.enabled = enabled
        self.total_tokens = 0        # tokens held by the tree
        self.protected_tokens = 0    # tokens in nodes referenced by some request

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.protected_tokens

    # ---- lookup -------------------------------------------------------------------------
    def match_prefix(self, keys: list[int]) -> tuple[torch.Tensor, Node]:
        """Longest cached prefix of `keys`: (slot ids, last node). Splits a node on a partial match."""
        if not self.enabled or not keys:
            return torch.empty(0, dtype=torch.int64), self.root
        node, pos, parts = self.root, 0, []
        now = next(_clock)
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_len(child.key, keys, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node, pos = child, pos + n
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return slots, node

    def _split(self, child: Node, n: int) -> Node:
        """Split `child` after its first n keys; returns the new upper node."""
        upper = Node(child.key[:n], child.value[:n], child.parent)
        upper.ref = child.ref
        upper.last_access = child.last_access
        child.parent.children[child.key[0]] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, keys: list[int], slots: torch.Tensor) -> int:
        """Insert keys -> slots. Returns how many leading keys were already cached; the caller frees its
        own copies of those slots (the tree keeps the older ones). Slots after that are owned by the tree."""
        if not self.enabled:
            return 0
        node, pos = self.root, 0
        now = next(_clock)
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                new = Node(list(keys[pos:]), slots[pos:].clone(), node)
                new.last_access = now
                node.children[keys[pos]] = new
                self.total_tokens += len(new.key)
                return pos
            n = _common_len(child.key, keys, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    # ---- references ---------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref == 0:
                self.protected_tokens += len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.protected_tokens -= len(node.key)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unreferenced leaves (LRU). Returns slots freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            self._free_slots(leaf.value)
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unreferenced node (used when the engine is idle and a clean slate is wanted)."""
        self.evict(self.total_tokens)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())


def _common_len(a: list[int], b: list[int], start: int) -> int:
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i
