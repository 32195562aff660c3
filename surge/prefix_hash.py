"""Names of KV blocks by their prefix: shared by the scheduler's prefix cache and the
frontend's data-parallel router, so both name a prompt's blocks alike."""

from __future__ import annotations

import hashlib
from array import array


def block_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """A collision-resistant name: Python's hash() of int tuples can be steered by a crafted
    prompt, which would let one client's blocks stand in for another's prefix."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def prefix_hashes(token_ids: list[int], block_size: int, limit: int) -> list[bytes]:
    """The chained names of the first `limit` full blocks of token_ids."""
    names: list[bytes] = []
    parent = None
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        parent = block_hash(parent, tuple(token_ids[start : start + block_size]))
        names.append(parent)
    return names
