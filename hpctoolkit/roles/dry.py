"""`HPCTOOLKIT_NODE_DRY`: which roles only print where they landed instead of doing their work.

Read by `roles.dispatch` (the plan's roles) and `roles.evaluate`, which is dry whenever the trainers
are: it serves what they exported.
"""

from __future__ import annotations

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import ROLES


def dry_roles(value: str | None) -> frozenset[str]:
    """Roles `HPCTOOLKIT_NODE_DRY` makes dry: "1" all, "0"/unset none, else a comma list."""
    value = (value or "0").strip()
    if value == "1":
        return frozenset(ROLES)
    if value in ("", "0"):
        return frozenset()
    roles = frozenset(r.strip() for r in value.split(",") if r.strip())
    unknown = sorted(roles - set(ROLES))
    if unknown:
        raise ConfigError(f"HPCTOOLKIT_NODE_DRY names unknown roles {unknown}; valid: {list(ROLES)}")
    return roles


def dry_now() -> frozenset[str]:
    """The roles this process's environment makes dry."""
    return dry_roles(envs.get(envs.HPCTOOLKIT_NODE_DRY.name))
