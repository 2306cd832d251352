"""The op registry and every op (importing this package registers them all)."""

from coda_lang.ops import elementwise, reductions, structural  # noqa: F401  (registration)
from coda_lang.ops.registry import (
    BY_SURFACE,
    COMBINES,
    REGISTRY,
    SUGAR,
    Combine,
    Ctx,
    OpDef,
    StageShape,
    combine_rule,
    resolve,
)

__all__ = [
    "BY_SURFACE",
    "COMBINES",
    "REGISTRY",
    "Combine",
    "Ctx",
    "OpDef",
    "SUGAR",
    "StageShape",
    "combine_rule",
    "resolve",
]
