"""The op registry and every op (importing this package registers them all)."""

from coda_lang.ops import elementwise, reductions, structural  # noqa: F401  (registration)
from coda_lang.ops.registry import (
    BY_SURFACE,
    COMBINES,
    REGISTRY,
    SUGAR,
    Arith,
    Bound,
    BoundRule,
    Combine,
    Ctx,
    Lanes,
    Locality,
    Lowerings,
    OpDef,
    Role,
    StageShape,
    combine_rule,
    grouped_reads,
    resolve,
)

__all__ = [
    "Arith",
    "BY_SURFACE",
    "Bound",
    "BoundRule",
    "COMBINES",
    "REGISTRY",
    "Combine",
    "Ctx",
    "Lanes",
    "Locality",
    "Lowerings",
    "OpDef",
    "Role",
    "SUGAR",
    "StageShape",
    "combine_rule",
    "grouped_reads",
    "resolve",
]
