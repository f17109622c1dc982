"""w4a16 MXFP4 GEMM at many activation rows in Pallas Mosaic GPU (NVIDIA Hopper, WGMMA): the E2M1
decode inside a large-tile GEMM's K loop.

Computes ``out = x · Wᵀ`` for a bfloat16 activation x [M, K] (M >= a few hundred rows) and an
MXFP4 weight as packed E2M1 bytes [N, K/2] with E8M0 scale bytes K-major [K/32, N] (what
:func:`jax_mxfp4.prepare_decode` stores: bytes in the "lanes" order; the natural order of a plain
MXFP4Array is moved to the :func:`jax_mxfp4.decode_prepared.pair_order_bytes` order in registers
by warp shuffles, then decoded by the pairs PTX) as ``outᵀ = W · xᵀ`` tile by tile. The
decode-size kernel (:mod:`jax_mxfp4.kernels.wgemm_mgpu`) reads every weight byte once and meets
few activation rows; here each decoded weight tile meets ``mt`` (64, 128 or 256) activation rows, so
the decode's cost is spread over ``mt`` multiply-adds per element and the tensor cores set the
pace, as in a bfloat16 GEMM. The alternative (a pass that decodes the whole weight to bfloat16,
then XLA's GEMM) writes and reads 2 bytes per weight element more (timings in
docs/performance.md).

One CTA per (128 weight rows, ``mt`` activation rows) output tile; grid N/128 x ceil(M/mt), the
activation tiles of one weight tile in consecutive CTAs (the weight tile is read from HBM once and
then from L2). Three warpgroups: a TMA warpgroup fills ``stages`` shared-memory slots (x's
[mt, bk] tile, the [128, bk/2] weight bytes, their [bk/32, 128] scale bytes) through
:func:`jax_mxfp4.kernels.wgemm_mgpu._k_split_own_pipeline`, and gives up registers to the two
compute warpgroups (``setmaxnreg`` :data:`REGISTERS`: 40 + 2 x 232 of the 3 x 168 a CTA of 384
threads has, as jax's ``emit_pipeline_warp_specialized`` does; accumulators of 128 registers per
thread spill at 168). Each compute warpgroup owns 64 weight rows: per step it loads its
[64, bk/2] bytes in Mosaic GPU's 8-bit WGMMA layout, decodes them in registers by the "lanes"
inline PTX (one bfloat16 multiply per register where the warp's scale bytes allow; the same code
the decode-size kernel runs: :func:`jax_mxfp4.kernels.wgemm_mgpu._wgmma_step`) and issues ``W_tile · x_tileᵀ`` as WGMMAs
with the decoded tile as the register A operand and x's tile from shared memory as B, into its
float32 accumulator [64, mt]. The epilogue casts it to ``out_dtype`` and stores it transposed
([mt, 64] in shared memory through the WGMMA_TRANSPOSED layout), one TMA store per warpgroup.

Numerics: E2M1 x 2^(b-127) is exact in bfloat16 (0x00 the bfloat16 subnormal 2^-127, 0xFF NaN:
:func:`jax_mxfp4.mx_format.e8m0_to_bf16_bits`'s rule), its products with bfloat16 x exact in
float32, WGMMA accumulates in float32: equal to backend "xla" up to the order of float32
accumulation (the contract of every GEMM path of the project).

Status: lowers for CUDA on a CPU machine (tests/test_wgemm_tiles_mgpu.py; the PTX of the decodes
and of the quad transpose run in a NumPy model of a warp in tests/test_wgemm.py); checked and timed
on the H200 (tests/gpu/test_gpu_wgemm.py; numbers in docs/performance.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..checks import check_output_dtype
from ..mx_format import BLOCK_SIZE, as_scale_bytes
from .wgemm_mgpu import (_WG_ROWS, _check_eager_device, _k_split_own_pipeline, _load, _plgpu, _swizzle, _tiled,
                         _wgmma_step, check_2d_arrays)

DECODES = ("lanes", "natural")  # TilesConfig.decode: one per byte order (wgemm_mgpu's one-fragment decodes)
W_ORDERS = ("lanes", "natural")  # byte orders of the weight mgpu_w4a16_tiles reads
REGISTERS = (40, 232)  # setmaxnreg of the TMA / each compute warpgroup (as jax's pipeline)
MTS = (64, 128, 256)  # TilesConfig.mt: activation rows per CTA (the WGMMA N side, <= 256)
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may take on sm_90 (H100/H200: 227 KiB)
_SMEM_RESERVE = 2 * 1024  # barriers and Mosaic GPU's own scratch


@dataclasses.dataclass(frozen=True)
class TilesConfig:
    """Tiling of :func:`mgpu_w4a16_tiles`.

    mt: activation rows per CTA, one of :data:`MTS` (each compute warpgroup's float32
    accumulator is [64, mt]: mt/2 registers per thread); bk: K elements per pipeline step, a
    multiple of 64 (whole 128-byte swizzle rows of x); stages: pipeline depth, lowered to what
    fits in shared memory (at least 2); chunks: each warpgroup decodes a step's tile in this many
    parts, issuing each part's WGMMAs before decoding the next (parts of whole 64-column x
    swizzle tiles: ``bk / chunks`` a multiple of 64); decode:
    the weight's byte order (:func:`mgpu_w4a16_tiles`'s ``w_order``): "lanes" (prepare_decode's
    default) or "natural" (a plain MXFP4Array's bytes: each 32-bit word moved to the
    :func:`jax_mxfp4.decode_prepared.pair_order_bytes` order across its quad of threads by two
    warp shuffles, then the pairs PTX); both fold the scale multiply where they can (module doc).
    Raises TypeError / ValueError naming the field and the rule."""

    mt: int = 128
    bk: int = 128
    stages: int = 4
    chunks: int = 2
    decode: str = "lanes"

    def __post_init__(self):
        for name in ("mt", "bk", "stages", "chunks"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"TilesConfig.{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))  # numpy ints as Python ints (Pallas grids and shapes take those)
        if not isinstance(self.decode, str) or self.decode not in DECODES:  # a str: `in` on an array is elementwise
            raise ValueError(f"TilesConfig.decode must be one of {DECODES}, got {self.decode!r}")
        if self.mt not in MTS:
            raise ValueError(f"TilesConfig.mt must be one of {MTS} (the WGMMA N side), got {self.mt}")
        if self.bk < 64 or self.bk % 64:
            raise ValueError(f"TilesConfig.bk must be a positive multiple of 64 (whole 128-byte swizzle rows of x), "
                             f"got {self.bk}")
        if self.stages < 2:
            raise ValueError(f"TilesConfig.stages must be >= 2 (a TMA warpgroup feeding two compute warpgroups), "
                             f"got {self.stages}")
        if self.chunks < 1 or self.bk % (64 * self.chunks):
            raise ValueError(f"TilesConfig.chunks={self.chunks} must split bk={self.bk} into parts of a multiple of "
                             "64 columns (whole x swizzle tiles)")

    @property
    def cta_rows(self) -> int:
        """Weight rows of one CTA: two compute warpgroups of 64 rows."""
        return 2 * _WG_ROWS


def smem_bytes(cfg: TilesConfig, out_itemsize: int) -> tuple[int, int]:
    """(bytes per pipeline stage, fixed bytes) of shared memory for ``cfg``: per stage x's
    [mt, bk] bfloat16 tile, the [cta_rows, bk/2] weight bytes and [bk/32, cta_rows] scale bytes;
    fixed, the two [mt, 64] output tiles of ``out_itemsize`` bytes."""
    rows = cfg.cta_rows
    per_stage = cfg.mt * cfg.bk * 2 + rows * cfg.bk // 2 + cfg.bk // BLOCK_SIZE * rows
    return per_stage, 2 * cfg.mt * _WG_ROWS * out_itemsize


def fitted_stages(cfg: TilesConfig, out_itemsize: int, steps: int) -> int:
    """Pipeline depth for ``cfg``: ``cfg.stages`` capped by the K steps and by shared memory
    (:data:`SMEM_LIMIT`); ValueError where two stages do not fit or K has fewer than two steps."""
    per_stage, fixed = smem_bytes(cfg, out_itemsize)
    stages = min(cfg.stages, steps, (SMEM_LIMIT - _SMEM_RESERVE - fixed) // per_stage)
    if stages < 2:
        raise ValueError(f"mgpu_w4a16_tiles: {cfg} with a {out_itemsize}-byte output needs two pipeline stages of "
                         f"{per_stage} bytes of shared memory (+{fixed} fixed) and two K steps ({steps} here): "
                         "lower mt or bk")
    return stages


def mgpu_w4a16_tiles(x, w_data, w_scales, out_dtype=jnp.bfloat16, cfg: TilesConfig | None = None,
                     w_order: str = "lanes"):
    """``x · Wᵀ`` for bfloat16 ``x`` [M, K] and a prepared MXFP4 weight W [N, K] (module doc).

    Args:
      x: bfloat16 [M, K], M a multiple of 8 (Mosaic GPU's TMA tiles of 8 rows; rows past M in the
        last tile are read as zeros by TMA and never stored).
      w_data: uint8 [N, K/2]: packed E2M1 bytes in the byte order ``w_order`` names; N a
        multiple of ``cfg.cta_rows`` (128).
      w_scales: E8M0 scales K-major [K/32, N], uint8 bytes or float8_e8m0fnu (OCP MX v1.0 §5.4:
        2^(b-127), 0xFF NaN).
      out_dtype: bfloat16, float16 or float32 (None: float32).
      cfg: :class:`TilesConfig` (None: :func:`default_tiles_config` for the shape and order).
      w_order: "lanes" (:func:`jax_mxfp4.decode_prepared.lanes_order_bytes`, what
        :func:`jax_mxfp4.prepare_decode` stores by default; the "lanes" decode) or "natural"
        (the bytes as quantized, a plain MXFP4Array's; the "natural" decode: the
        :func:`jax_mxfp4.decode_prepared.pair_order_bytes` order made in registers by warp
        shuffles, then the pairs PTX). x is read as it is.
    Returns ``out_dtype`` [M, N]. Runs only on an NVIDIA Hopper GPU (sm_90a) through Mosaic GPU.
    Raises:
      TypeError: arrays or ``cfg`` of the wrong kind.
      RuntimeError: called eagerly with ``x`` on a device other than a GPU.
      ValueError: ranks, shapes and dtypes (K a multiple of ``cfg.bk`` with at least two steps,
        M a multiple of 8, N of ``cfg.cta_rows``), an ``out_dtype`` that is not a float, an
        unknown ``w_order`` or one the decode of ``cfg`` cannot read (each order has its own
        decode of the same name), or a tiling whose two pipeline
        stages do not fit in shared memory.
    """
    check_2d_arrays("mgpu_w4a16_tiles", (("x", x, "bfloat16 [M, K]"), ("w_data", w_data, "uint8 [N, K/2]"),
                                         ("w_scales", w_scales, "E8M0 scales [K/32, N]")))
    out_dtype = check_output_dtype(out_dtype, "mgpu_w4a16_tiles: out_dtype")
    m, k = x.shape
    n, half_k = w_data.shape
    if not isinstance(w_order, str) or w_order not in W_ORDERS:
        raise ValueError(f"mgpu_w4a16_tiles: w_order must be one of {W_ORDERS}, got {w_order!r}")
    if cfg is None:
        cfg = default_tiles_config(m, n, k, out_dtype, w_order)
        if cfg is None:
            raise ValueError(f"mgpu_w4a16_tiles: no tiling for M={m}, N={n}, K={k}: {unsupported_reason(m, n, k)}")
    if not isinstance(cfg, TilesConfig):
        raise TypeError(f"mgpu_w4a16_tiles: cfg must be a TilesConfig or None, got {type(cfg).__name__}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"mgpu_w4a16_tiles: x must be bfloat16, got {x.dtype}")
    if w_data.dtype != jnp.uint8 or half_k * 2 != k:
        raise ValueError(f"mgpu_w4a16_tiles: w_data must be uint8 [N, K/2] with K={k}, got {w_data.dtype} "
                         f"{tuple(w_data.shape)}")
    if w_scales.dtype == jnp.float8_e8m0fnu:
        w_scales = as_scale_bytes(w_scales)
    if w_scales.dtype != jnp.uint8 or tuple(w_scales.shape) != (k // BLOCK_SIZE, n):
        raise ValueError(f"mgpu_w4a16_tiles: w_scales must be the E8M0 bytes K-major, uint8 or float8_e8m0fnu "
                         f"[{k // BLOCK_SIZE}, {n}], got {w_scales.dtype} {tuple(w_scales.shape)}")
    if w_order != cfg.decode:
        raise ValueError(f"mgpu_w4a16_tiles: w_order={w_order!r} bytes need TilesConfig(decode={w_order!r}), "
                         f"got decode={cfg.decode!r}")
    why = unsupported_reason(m, n, k, cfg)  # N a multiple of cfg.cta_rows
    if why:
        raise ValueError(f"mgpu_w4a16_tiles: {why}")
    osize = jnp.dtype(out_dtype).itemsize
    steps = k // cfg.bk
    stages = fitted_stages(cfg, osize, steps)
    return _tiles_call(x, w_data, w_scales, cfg=cfg, stages=stages, out_dtype=out_dtype)


def _tiles_call(x, w_data, scales, *, cfg: TilesConfig, stages: int, out_dtype):
    plgpu = _plgpu()
    m, k = x.shape
    n = w_data.shape[0]
    mt, bk, rows = cfg.mt, cfg.bk, cfg.cta_rows
    hb, nb = bk // 2, bk // BLOCK_SIZE
    steps = k // bk
    n_tiles, m_tiles = n // rows, -(-m // mt)
    x_tr, w_tr = _tiled(_swizzle(bk * 2), 2), _tiled(_swizzle(hb), 1)
    osize = jnp.dtype(out_dtype).itemsize
    # the transposed store of each warpgroup's tile, as _k_split_call's finish does it
    o_tr = _tiled(128, 2) if osize == 2 else ()

    def body(x_g, w_g, s_g, out_g, x_smem, w_smem, s_smem, o_smem, ready, consumed):
        cta = lax.axis_index("cta")
        n_tile, m_tile = lax.div(cta, m_tiles), lax.rem(cta, m_tiles)  # a weight tile's CTAs adjacent
        wg = lax.axis_index("wg")
        cols = pl.ds(n_tile * rows, rows)
        xrows = pl.ds(m_tile * mt, mt)

        def fetch(t, slot):  # step t's tiles into ``slot``, three copies arriving on ready[slot]
            plgpu.copy_gmem_to_smem(x_g.at[xrows, pl.ds(t * bk, bk)], x_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(w_g.at[cols, pl.ds(t * hb, hb)], w_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(s_g.at[pl.ds(t * nb, nb), cols], s_smem.at[slot], ready.at[slot])

        def wg_rows():  # this warpgroup's 64 weight rows, inside the CTA's
            return pl.ds(wg * _WG_ROWS, _WG_ROWS)

        def step(slot, acc_ref):
            byt = _load(w_smem.at[slot].at[wg_rows()], plgpu.Layout.WGMMA_8BIT)
            _wgmma_step((x_smem.at[slot],), byt, s_smem.at[slot].at[:, wg_rows()], acc_ref, hb, cfg.decode,
                        chunks=cfg.chunks, fold=True)
            plgpu.wgmma_wait(0)

        def compute_context(run):
            def scope(acc_ref):
                run(acc_ref)
                out_t = plgpu.layout_cast(acc_ref[...].astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.transpose_ref(o_smem.at[wg], (1, 0))[...] = out_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], out_g.at[xrows, pl.ds(n_tile * rows + wg * _WG_ROWS, _WG_ROWS)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(scope, plgpu.ACC((_WG_ROWS, mt), jnp.float32))

        _k_split_own_pipeline(wg, 2, steps, stages, fetch=fetch, step=step, ready=ready, consumed=consumed,
                              compute_context=compute_context, registers=REGISTERS)

    _check_eager_device(x, "mgpu_w4a16_tiles")
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n_tiles * m_tiles,), grid_names=("cta",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=dict(
            x_smem=plgpu.SMEM((stages, mt, bk), jnp.bfloat16, transforms=x_tr),
            w_smem=plgpu.SMEM((stages, rows, hb), jnp.uint8, transforms=w_tr),
            s_smem=plgpu.SMEM((stages, nb, rows), jnp.uint8),
            o_smem=plgpu.SMEM((2, mt, _WG_ROWS), out_dtype, transforms=o_tr),
            ready=plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # one arrival per TMA copy
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages)),  # one per compute warpgroup
    )
    return f(x, w_data, scales)


def _check_dims(fn: str, m, n, k) -> None:
    """``m``, ``n``, ``k`` must be ints (numpy integers too, not bool): TypeError naming ``fn``."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{fn}: {name} must be an int, got {v!r}")


def unsupported_reason(m: int, n: int, k: int, cfg: TilesConfig | None = None) -> str | None:
    """None if :func:`mgpu_w4a16_tiles` takes [m, k] x [n, k] with ``cfg`` (None: any
    :class:`TilesConfig` with bk 128 or 64), else the rule it breaks. TypeError for non-int
    sizes or a ``cfg`` that is not a TilesConfig."""
    _check_dims("unsupported_reason", m, n, k)
    if cfg is not None and not isinstance(cfg, TilesConfig):
        raise TypeError(f"unsupported_reason: cfg must be a TilesConfig or None, got {type(cfg).__name__}")
    if m < 1 or n < 1 or k < 1:
        return f"M, N and K must be >= 1, got M={m}, N={n}, K={k}"
    if m % 8:
        return f"M={m} is not a multiple of 8 (Mosaic GPU's TMA tiles of 8 activation rows)"
    rows = cfg.cta_rows if cfg is not None else 2 * _WG_ROWS
    if n % rows:
        return f"N={n} is not a multiple of {rows} weight rows (a CTA's two compute warpgroups)"
    bks = (cfg.bk,) if cfg is not None else (128, 64)
    if not any(k % bk == 0 and k // bk >= 2 for bk in bks):
        return f"K={k} is not a multiple of bk={' or '.join(map(str, bks))} with at least two K steps"
    return None


def default_tiles_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16, w_order: str = "lanes") -> TilesConfig | None:
    """The tiling for a shape (None where :func:`unsupported_reason` says no), from kernel times on
    an NVIDIA H200 (docs/performance.md): 256 activation rows per CTA, bk 64, 4 stages; 128-row
    tiles where 256-row ones would leave the grid under 128 CTAs (the H200 has 132 SMs) or the
    output is 4 bytes wide (a float32 [256, 64] tile per warpgroup leaves room for two pipeline
    stages only). ``w_order``: the decode of that name. The "natural" decode takes bk 128 in two
    stages with each step decoded in two chunks at 256-row tiles, where K allows (its heavier
    decode is hidden better behind the first chunk's WGMMAs). Raises TypeError for non-int sizes,
    ValueError for another ``w_order`` or an ``out_dtype`` other than bfloat16, float16, float32
    (None: float32)."""
    _check_dims("default_tiles_config", m, n, k)
    if not isinstance(w_order, str) or w_order not in W_ORDERS:
        raise ValueError(f"default_tiles_config: w_order must be one of {W_ORDERS}, got {w_order!r}")
    out_dtype = check_output_dtype(out_dtype, "default_tiles_config: out_dtype")
    if unsupported_reason(m, n, k):
        return None
    wide = jnp.dtype(out_dtype).itemsize > 2
    bk = 128 if k % 128 == 0 and k // 128 >= 2 else 64
    if not wide and -(-m // 256) * (n // (2 * _WG_ROWS)) >= 128:  # K: unsupported_reason above (64 | K, 2 steps)
        if w_order != "lanes" and bk == 128:
            return TilesConfig(mt=256, bk=128, stages=2, chunks=2, decode=w_order)
        return TilesConfig(mt=256, bk=64, stages=4, chunks=1, decode=w_order)
    return TilesConfig(mt=128, bk=bk, stages=4, chunks=bk // 64, decode=w_order)
