"""Content addresses for KV blocks: what makes two requests' blocks the same block.

The K/V of a token depend on the token and on every token before it, so a block's content is
fixed by its own token ids *and* everything in front of it. A full block's key is therefore a
chained hash: the hash of its parent block's key, its own token ids and its extra keys (a cache
salt on the first block: requests with different salts never share, so a tenant can opt out).

    key(block 0) = H(""        , tokens[0:16],  salt)
    key(block 1) = H(key(b 0)  , tokens[16:32])
    key(block 2) = H(key(b 1)  , tokens[32:48])      equal keys <=> equal prefixes

The hash is SHA-256 (vLLM's default is also a cryptographic hash: with a 64-bit hash two
prefixes can collide, and a collision would silently serve another prompt's K/V). On top of
that, a cached block keeps what was hashed (`BlockContent`: the parent's key, its own token ids,
the salt) and a hit must match it exactly. That rules out two different token runs sharing a
block under one parent key; it does not compare the parents' *contents*, only their keys, so two
different prefixes could still meet if their parent keys collided. For SHA-256 the chance is
about n^2 / 2^257 for n blocks ever hashed: nothing a server will meet.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = bytes


@dataclass(frozen=True, slots=True)
class BlockContent:
    """Everything a full block's key was computed from: compared on every hit."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    salt: str | None


def block_content(
    parent: BlockKey | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockContent:
    """The chained key of one full block, with what it was computed from.

    key = SHA-256 over the parent's key (b"\\x00" for a first block), the token ids and, when
    given, the salt, length-prefixed so no salt can pass for tokens ("" is a salt, None is
    none). A pure function: equal (parent, tokens, salt), equal key; a different parent or
    salt, a different key, even for equal tokens (a block repeating its parent is its own)."""
    digest = hashlib.sha256(parent or b"\x00")
    digest.update(array("q", token_ids).tobytes())
    if salt is not None:  # length-prefixed, so no salt can pass for tokens
        encoded = salt.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return BlockContent(digest.digest(), parent, tuple(token_ids), salt)


@dataclass
class PrefixCacheStats:
    """Aggregate hit rate: prompt tokens looked up, and how many were found cached."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
        }
