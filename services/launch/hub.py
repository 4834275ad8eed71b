"""Checkpoints and adapters named by hub id: `--model <org>/<name>[@<revision>]` and
`--lora-modules NAME=<org>/<name>[@<revision>]` are fetched with huggingface_hub's `snapshot_download` into its
cache (HF_HUB_CACHE / HF_HOME), which honours HF_HUB_OFFLINE (the cache only) and HF_TOKEN (gated or private
repositories) itself. A local path that exists always wins over an id of the same spelling. Light: no torch."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Optional

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(@(?P<rev>[A-Za-z0-9._/-]+))?$")


@dataclass(frozen=True)
class Resolved:
    path: str                       # a local directory (or file)
    repo_id: Optional[str] = None   # None: a local path was given
    revision: Optional[str] = None  # the commit the snapshot is at

    def record(self) -> dict:
        """What stack.json and /v1/models say about where the weights came from."""
        return {"path": self.path} if self.repo_id is None else {
            "path": self.path, "hub_id": self.repo_id, "revision": self.revision}


def parse_hub_id(text: str) -> Optional[tuple[str, Optional[str]]]:
    """'<org>/<name>[@<revision>]' -> (repo id, revision or None); None for anything else."""
    m = _HUB_ID.match(text.strip())
    return (m["repo"], m["rev"]) if m else None


@functools.lru_cache(maxsize=64)          # the launcher asks again for what it records: one download
def resolve(ref: str, what: str = "--model") -> Resolved:
    """A local path as it is, else a hub id downloaded (or found in the cache). A SystemExit that says why
    for anything that is neither."""
    if os.path.exists(ref):
        return Resolved(os.path.abspath(ref))
    parsed = parse_hub_id(ref)
    if parsed is None:
        raise SystemExit(f"{what} {ref!r} is neither an existing directory nor a hub id (<org>/<name>[@<revision>])")
    repo_id, revision = parsed
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise SystemExit(f"{what} {ref!r}: hub ids need huggingface_hub (pip install huggingface_hub)") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = _snapshot(snapshot_download, repo_id, revision, local_only=offline)
    except GatedRepoError:
        raise SystemExit(f"{what} {ref!r}: the repository is gated; accept its terms on the hub and set HF_TOKEN") \
            from None
    except RepositoryNotFoundError:
        raise SystemExit(f"{what} {ref!r}: no such repository on the hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise SystemExit(f"{what} {ref!r}: the repository has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set and the cache" if offline else "the hub is unreachable and the cache"
        raise SystemExit(f"{what} {ref!r}: {where} ({cache_root()}) has no snapshot of it"
                         + (f" at {revision!r}" if revision else "")) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SystemExit(f"{what} {ref!r}: could not fetch it from the hub ({type(exc).__name__}: {exc})") from None
    return Resolved(os.path.abspath(path), repo_id, os.path.basename(os.path.normpath(path)))


def _snapshot(snapshot_download, repo_id: str, revision: str | None, local_only: bool) -> str:
    """Offline: straight from the cache. Online: the hub, falling back on the cache when the hub can't be
    reached (some huggingface_hub releases, given a commit hash, list the tree outside their own fallback)."""
    token = os.environ.get("HF_TOKEN") or None
    if local_only:
        return snapshot_download(repo_id, revision=revision, token=token, local_files_only=True)
    try:
        return snapshot_download(repo_id, revision=revision, token=token)
    except (ConnectionError, *_unreachable_errors()):
        return snapshot_download(repo_id, revision=revision, token=token, local_files_only=True)


def _unreachable_errors() -> tuple[type[Exception], ...]:
    try:
        import httpx
        return (httpx.ConnectError, httpx.TimeoutException)
    except ImportError:
        return ()


def cache_root() -> str:
    try:
        from huggingface_hub import constants
        return constants.HF_HUB_CACHE
    except ImportError:
        return os.environ.get("HF_HUB_CACHE", "~/.cache/huggingface/hub")
