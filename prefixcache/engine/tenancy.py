"""Tenant namespaces and operator-approved shared prefixes.

With tenants, every block a request caches carries its tenant's namespace
(:func:`~prefixcache.cache.hashing.tenant_extra_key`) in its hash and in the stored key that a hit
is verified against, so tenants never share cache entries and can't probe each other's prompts
through TTFT. The exception is an *approved shared prefix*: public text the operator declares
(e.g. the product's system prompt). A block lying entirely inside the part of a prompt that equals
an approved prefix is keyed without the namespace and is shared by every tenant; the first block
that goes beyond it, and everything after, is tenant-keyed::

    prompt:   | approved prefix (public)      | tenant's own text ...           |
    blocks:   | shared | shared | tenant-keyed (straddles the end) | tenant-keyed |

The shared part of a prompt is its longest common token prefix with any approved prefix, so a
prompt that tokenizes the approved text's last token differently still shares every block before
it, and any prefix of public text is itself public.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.cache.block import common_prefix_length
from prefixcache.errors import lone_surrogate

MAX_TENANT_CHARS = 256


def validate_tenant(tenant: str | None) -> str | None:
    """Returns ``tenant``; raises ValueError naming ``tenant`` unless None or 1..256 characters of
    valid Unicode (a lone surrogate, which a JSON keys file can carry, fails the tenant's hash key)."""
    if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS):
        raise ValueError(f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters")
    if tenant is not None and (why := lone_surrogate(tenant)) is not None:
        raise ValueError(f"tenant {why}")
    return tenant


class ApprovedPrefixes:
    """The operator's approved shared prefixes, as token ids."""

    def __init__(self) -> None:
        self._prefixes: list[tuple[int, ...]] = []

    def add(self, token_ids: Sequence[int]) -> None:
        """Approves ``token_ids`` (a duplicate is ignored).

        Raises:
            ValueError: empty ``token_ids``.
        """
        prefix = tuple(token_ids)
        if not prefix:
            raise ValueError("an approved prefix must not be empty")
        if prefix not in self._prefixes:
            self._prefixes.append(prefix)

    def shared_length(self, token_ids: Sequence[int]) -> int:
        """Tokens at the head of ``token_ids`` that equal the head of some approved prefix."""
        return max((common_prefix_length(prefix, token_ids) for prefix in self._prefixes), default=0)

    def __len__(self) -> int:
        return len(self._prefixes)

    def __iter__(self):
        return iter(self._prefixes)
