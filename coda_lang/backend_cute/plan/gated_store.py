"""quack's gated TileStore with an fp8 (e4m3, e5m2) tile on SM90: a paired stage's half-width fp8 store.

What it does: `GatedFp8Store(name)` is quack's `TileStore(name, gated=True)` whose `to_params` also
takes an 8-bit tile on SM90, where quack 0.6.5 asserts 16 bits ("SM90's STSM path remains 16-bit
only"). Nothing else of quack's op changes, because its SM90 store path already does what an 8-bit
tile needs:
- the register-to-smem copy is `make_tiled_copy_S(atom, D's tiled_copy_r2s)`: the thread-value layout
  is the *source* layout of the 16-bit STSM C atom over the WGMMA accumulator (a thread's registers at
  rows r, r+8 and columns 2c, 2c+1, 8+2c, 9+2c of each 16x16 block of the half-width subtile, r = lane
  / 4, c = lane % 4), reused for the half-width tile (tile_N % 32: each 32 accumulator columns give 16
  stored ones). For an 8-bit tile `copy_utils.get_smem_store_atom` gives a universal copy of two
  elements (16 bits) instead of STSM. A copy moves the register at (thread, value) to the logical
  position the source layout gives it, whether STSM (which shuffles across lanes in hardware) or a
  per-thread store does it, and `retile` enumerates a thread's values in the tiled layout's order
  whatever the atom's size: so each register lands where it lands on the 16-bit path.
- `store_convert` applies the gated register permute at f32 granularity (`permute_gated_Cregs_f32`,
  quad shuffles: after the pairs a thread holds half-width columns c, 4+c, 8+c, 12+c, the layout
  above wants 2c, 2c+1, 8+2c, 9+2c) for `gated and arch in (90, 120) and dtype.width < 16`, before
  the cvt to fp8 (`cvt.rn.satfinite`, after the emitted epilogue's clamp).
Checked on the CPU by tracing the layouts (tests/test_fp8_kernels.py,
`test_sm90_gated_fp8_store_layout`): every half-width position gets its own value, the same map as
the 16-bit STSM path's, at 64- and 128-row subtiles of 32 and 64 columns.
What it does not: fp4, an m-major tile, SM100/SM120 (quack's TileStore takes those already; this op
is emitted only for SM90 fp8 half-width stores), or the subtile: the TMA store of an 8-bit half tile
needs rows of at least 16 bytes, a subtile of at least 32 accumulator columns, which the planner's
tiling rules hold (planner._tiling).
Invariants: everything else is quack's TileStore, host and device; `config_key` adds `VERSION`,
bumped with any edit here (quack keys its disk cache of compiled kernels on the op's module, class
name and config_key, not on its source); other stores keep quack's own TileStore, so their emitted
sources and cache keys are unchanged.
"""

from __future__ import annotations

from typing import Any

import cutlass
from quack.epilogue.ops import TileStore, setup_epi_tensor

VERSION = 1


class GatedFp8Store(TileStore):
    """quack's gated TileStore, taking an 8-bit tile on SM90 too."""

    def __init__(self, name: str, rounding: Any = None) -> None:
        super().__init__(name, gated=True, rounding=rounding)

    def config_key(self) -> tuple[Any, ...]:
        return (*super().config_key(), "coda_gated_fp8", VERSION)

    def to_params(self, gemm: Any, args: Any) -> dict[str, Any]:
        tensor = getattr(args, self.name)
        if not (gemm.arch == 90 and tensor.element_type.width == 8):
            return super().to_params(gemm, args)
        # quack's TileStore.to_params for a gated tile, without its 16-bit assert on SM90
        layout = cutlass.utils.LayoutEnum.from_tensor(tensor)
        assert gemm.d_layout is None or gemm.d_layout.is_n_major_c()
        assert layout.is_n_major_c(), f"gated fp8 `{self.name}` must be n-major"
        assert gemm.cta_tile_shape_mnk[1] % 32 == 0, "gated epilogue on SM90 requires tile_N divisible by 32"
        assert gemm.epi_tile[1] % 32 == 0, (
            f"gated fp8 `{self.name}` on SM90: an epilogue subtile of {gemm.epi_tile[1]} columns halves "
            "to rows under the TMA store's 16 bytes"
        )
        setattr(gemm, self._layout_gemm_attr(), layout)
        setattr(gemm, self._dtype_gemm_attr(), tensor.element_type)
        epi_tile = self.epi_tile_fn(gemm, gemm.epi_tile)
        tma_atom, tma_tensor, smem_layout, epi_tile_out = setup_epi_tensor(gemm, tensor, epi_tile=epi_tile)
        return {
            self._tma_atom_key(): tma_atom,
            self.name: tma_tensor,
            self._smem_layout_key(): smem_layout,
            self._epi_tile_key(): epi_tile_out,
            self._dtype_field(): tensor.element_type,
        }
