"""Weight-stationary w4a16 MXFP4 GEMM in Pallas Mosaic GPU (NVIDIA Hopper, WGMMA).

Computes ``out = x · Wᵀ`` for a bfloat16 activation x [M, K] (M <= 256, decode sizes) and an
MXFP4 weight W (packed E2M1 bytes [N, K/2], E8M0 scale bytes [N, K/32]) as ``outᵀ = W · xᵀ``:
the weight's rows are the WGMMA M side (64 rows per warpgroup) and its decoded tile is the
REGISTER A operand; the activation rows (padded to a multiple of 16, or to 8: :func:`padded_rows`) are the WGMMA N side, read
from shared memory as the B operand. Per K step the weight bytes, the scales and x arrive by
TMA; the bytes are loaded into registers and decoded there by the inline PTX of
:mod:`jax_mxfp4.kernels.e2m1_asm` (Marlin-style lanes; the Triton kernel runs the same
instructions), the bytes in Mosaic GPU's 8-bit WGMMA register layout (each thread holds 4 bytes
of a row's 32-element block), block scale applied last:

- ``decode="ptx"`` (natural byte order): low nibble of byte j = element 2j, high nibble =
  element 2j+1; a contraction may be permuted identically on both operands, so each decoded half
  (low nibbles, high nibbles) meets its own half of x (:func:`split_x`, done once per call on
  the small activation): two WGMMAs per step; each 32-bit register becomes the four bfloat16x2
  registers of the thread's A fragment slots; x's columns follow :func:`_ptx_fragment_order`;
- ``decode="lanes"`` (for prepared weights): each output register is one bfloat16x2 of two
  consecutive elements, so the decoded tile is ONE [64, bk] fragment whose K columns are x's
  natural columns when the weight bytes are stored by :func:`jax_mxfp4.prepare_decode` (a 4x4
  byte transpose inside every 16-byte block, :func:`jax_mxfp4.decode_prepared.pair_order_bytes`,
  then each 32-bit word's nibbles regrouped by bfloat16 lane,
  :func:`jax_mxfp4.decode_prepared.lanes_order_bytes`): one x tile and one WGMMA per step, no
  per-call work on x, a mask and one multiply per output register (``e2m1_asm._DECODE_LANES_PTX``);
- the block scale 2^(b-127) is the bfloat16 of :func:`jax_mxfp4.mx_format.e8m0_to_bf16_bits`
  (byte 0 the subnormal 2^-127, 0xFF NaN), applied last: E2M1 x scale is exact in bfloat16, its
  products with x exact in float32, WGMMA accumulates in float32; results equal backend "xla" up
  to the order of float32 accumulation.

Two tilings (:class:`MgpuConfig`). Split-K (``k_split_wgs`` 1): ``plgpu.kernel`` +
``emit_pipeline``, one warpgroup per CTA, one CTA per (64-row tile, K split); the float32
partial sums are added afterwards in a fixed order. One kernel per call (``k_split_wgs`` 4, the
"lanes" decode: the dispatch default for prepared weights, :func:`default_mgpu_config`), instead
of the kernel plus XLA's split-K sum/transpose/cast (each extra kernel costs a launch gap at
decode sizes): the warp-specialized CTA's compute warpgroups share one 64-row tile and split each
K step between them, warpgroup 0 adds their partial sums in a fixed order and stores the final
``[mp, N]`` tile of ``out_dtype`` transposed, by TMA (:func:`_k_split_call`), through this
module's own warp-specialized pipeline (:func:`_k_split_own_pipeline`, no register reallocation:
jax 0.11.2's ``emit_pipeline_warp_specialized`` asks for more registers than a CTA of 4 compute
warpgroups is launched with and hangs, :func:`_ws_register_demand`). The scales arrive as E8M0
bytes in a K-major [K/32, N] layout by TMA and are converted to bfloat16 in registers
(``scales_form``; :func:`jax_mxfp4.prepare_decode` stores weights that way).

Status: every tiling the choosers pick lowers for CUDA on a CPU machine (tests/test_wgemm_mgpu.py);
on the H200 (jax 0.11.2) they are checked against backend "xla" (tests/gpu/test_gpu_wgemm_mgpu.py)
and timed (docs/performance.md). Dispatch takes it for decode-size w4a16 and a4w4 on Hopper
(``jax_mxfp4.backends.pallas.W4A16_MOSAIC_GPU``). Other tilings were measured slower and removed
(git history keeps them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..checks import check_output_dtype
from ..mx_format import BLOCK_SIZE, as_scale_bytes
from . import e2m1_asm

DECODES = ("ptx", "lanes")  # both load bytes in WGMMA_LAYOUT_8BIT and run inline PTX
_PAIR_DECODES = ("lanes",)  # one bfloat16x2 register per two elements in order: x read as it is
W_ORDERS = ("natural", "lanes")  # byte order of the packed weight (lanes_order_bytes of pair_order_bytes)
_WG_ROWS = 64  # rows of one warpgroup's WGMMA tile (M side)
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipeline may take (sm_90: 227 KiB)
K_SPLIT_WGS = (1, 4)  # MgpuConfig.k_split_wgs: compute warpgroups sharing one 64-row tile's K steps
_K_SLICE_MIN = 64  # K elements of one warpgroup's slice of a step: 32 weight bytes, 128 bytes of x


def _ws_register_demand(num_compute_wgs: int, memory_registers: int) -> tuple[int, int]:
    """(registers the ``setmaxnreg`` requests of ``plgpu.emit_pipeline_warp_specialized`` add up to,
    registers a CTA of its warpgroups is launched with) for ``num_compute_wgs`` compute warpgroups
    and one TMA warpgroup. Requests: the TMA warpgroup ``memory_registers`` per thread, each compute
    warpgroup ``floor8(min(256, (512 - memory_registers) / num_compute_wgs))`` (jax's
    ``pipeline._compute_registers``, jax 0.10.2 to 0.11.x; it divides the whole 64K register file).
    Pool: ``setmaxnreg.inc`` takes registers from the CTA's pool, the launch allocation, and blocks
    until enough are there (PTX ISA, "setmaxnreg"); Mosaic GPU launches with a known block size
    and ``nvvm.minctasm = 1``, so at most ``floor8(65536 / threads)`` (<= 255) registers per
    thread (ptxas with a launch bound takes that maximum: 168 for 384 threads). Demand > pool:
    a compute warpgroup waits in ``setmaxnreg.inc`` forever."""
    threads = 128 * (num_compute_wgs + 1)
    per_thread = min(255, 65536 // threads) // 8 * 8
    compute = int(min(256.0, (512 - memory_registers) / num_compute_wgs) // 8 * 8)
    return 128 * (memory_registers + num_compute_wgs * compute), threads * per_thread


def _plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported lazily (needs jaxlib's Mosaic GPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _load(ref, layout, optimized=True):
    """``plgpu.load`` of a whole ref with a layout: jax 0.10 takes the index positionally, jax 0.11
    deprecates it (the ref is indexed with ``.at`` instead)."""
    import inspect

    plgpu = _plgpu()
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiling of the Mosaic GPU w4a16 kernel. The defaults are what :func:`default_mgpu_config`
    picks for natural-order bytes when K is a multiple of 1024 (dispatch asks it per shape).

    bk: K elements per pipeline step (multiple of 32, divides K / split_k); split_k: K ranges
    summed afterwards; stages: pipeline depth (``max_concurrent_steps``; lowered where shared
    memory would not fit); decode: ``"ptx"`` or ``"lanes"`` (module doc).
    k_split_wgs (4; 1 = the split-K tiling): ONE kernel per call for the "lanes" decode, writing
    the final ``[M, N]`` output of ``out_dtype`` itself (no split-K sum, transpose or cast after
    it): each CTA owns 64 weight rows and the whole K range (grid N/64, ``split_k`` must be 1); its
    ``k_split_wgs`` compute warpgroups, fed by one TMA warpgroup, each take their own
    1/k_split_wgs slice of every pipeline step's K columns (``bk / k_split_wgs`` must be a multiple
    of 64, so each slice is whole swizzle tiles of the weight bytes and of x), and their float32
    partial sums are added in warpgroup order by warpgroup 0, which stores the transposed
    ``[mp, 64]`` tile by TMA (:func:`_k_split_call`); needs ``stages`` >= 2. It always folds the
    scale: x 2^126 and x scale as one bfloat16x2 multiply by 2^(b-1) wherever every thread of a
    warp has all its E8M0 bytes of the decoded part <= 128 (scales <= 2; one ``vote.sync.all`` per
    warp), the two-multiply form otherwise (:func:`_decode_folded`); same bits.
    chunks (one-kernel tiling): each warpgroup decodes its slice of a step in this many parts,
    issuing each part's WGMMAs before decoding the next (parts of whole 64-element x swizzle
    tiles); :func:`k_split_config` takes 2 where allowed.
    """

    bk: int = 256
    split_k: int = 4
    stages: int = 4
    decode: str = "ptx"
    k_split_wgs: int = 1
    chunks: int = 1

    def __post_init__(self):
        for name in ("bk", "split_k", "stages", "k_split_wgs", "chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"MgpuConfig.{name} must be an int, got {v!r}")
        if self.decode not in DECODES:
            raise ValueError(f"MgpuConfig.decode must be one of {DECODES}, got {self.decode!r}")
        if self.bk < BLOCK_SIZE or self.bk % BLOCK_SIZE:
            raise ValueError(f"MgpuConfig.bk must be a positive multiple of {BLOCK_SIZE}, got {self.bk}")
        if self.split_k < 1 or self.stages < 1:
            raise ValueError(f"MgpuConfig.split_k and stages must be >= 1, got {self.split_k}, {self.stages}")
        if self.k_split_wgs not in K_SPLIT_WGS:
            raise ValueError(f"MgpuConfig.k_split_wgs must be one of {K_SPLIT_WGS}, got {self.k_split_wgs!r}")
        if self.k_split_wgs > 1:
            if self.decode != "lanes":
                raise ValueError(f'MgpuConfig.k_split_wgs > 1 (the one-kernel tiling) needs decode="lanes", '
                                 f"got decode={self.decode!r}")
            if self.split_k != 1:
                raise ValueError(f"MgpuConfig.k_split_wgs > 1 needs split_k=1 (each CTA sums the whole K range "
                                 f"itself), got split_k={self.split_k}")
            if self.stages < 2:
                raise ValueError(f"MgpuConfig.k_split_wgs > 1 needs stages >= 2 (a TMA warpgroup feeding the compute "
                                 f"warpgroups), got stages={self.stages}")
        if self.chunks != 1:
            if self.k_split_wgs == 1:
                raise ValueError(f"MgpuConfig.chunks > 1 needs the one-kernel tiling (k_split_wgs > 1), "
                                 f"got chunks={self.chunks}, k_split_wgs={self.k_split_wgs}")
            slice_k = self.bk // self.k_split_wgs  # one warpgroup's K per step
            if self.chunks < 1 or slice_k % (self.chunks * _K_SLICE_MIN):
                raise ValueError(f"MgpuConfig.chunks={self.chunks} must divide each warpgroup's {slice_k} K columns "
                                 f"per step into parts of a multiple of {_K_SLICE_MIN} (whole 128-byte swizzle "
                                 "tiles of x)")
        if self.k_split_wgs > 1 and self.bk % (self.k_split_wgs * _K_SLICE_MIN):
            raise ValueError(f"MgpuConfig.k_split_wgs={self.k_split_wgs} needs bk to be a multiple of "
                             f"{self.k_split_wgs * _K_SLICE_MIN} (each warpgroup's K slice a multiple of "
                             f"{_K_SLICE_MIN}: whole swizzle tiles), got bk={self.bk}")


def _tiled(swizzle_bytes: int, itemsize: int):
    """TMA transforms of a shared-memory tile whose rows are swizzled by ``swizzle_bytes``: 8-row
    tiles one swizzle wide (``swizzle_bytes / itemsize`` elements), then the swizzle."""
    plgpu = _plgpu()
    return (plgpu.TilingTransform((8, swizzle_bytes // itemsize)), plgpu.SwizzleTransform(swizzle_bytes))


def _ws_stages(cfg: MgpuConfig, steps: int, per_stage: int, fixed: int, what: str) -> int:
    """Pipeline depth of a warp-specialized launcher: ``cfg.stages`` capped by the K steps and by
    what fits in shared memory (``fixed`` bytes + ``per_stage`` per stage); ValueError below two
    stages (the warp-specialized pipeline needs two), ``what`` naming the configuration."""
    stages = min(cfg.stages, steps, (_SMEM_BUDGET - fixed) // per_stage)
    if stages < 2:
        raise ValueError(f"mgpu_w4a16: {what} needs two pipeline stages ({steps} K steps of {per_stage} "
                         "bytes of shared memory each): lower bk (or split_k), or K is too short")
    return stages


def _k_split_smem(mp: int, bk: int, kw: int, out_itemsize: int, scale_itemsize: int = 1) -> tuple[int, int]:
    """Shared memory of the one-kernel launcher (``k_split_wgs = kw``): bytes per pipeline stage
    (x tile bf16, packed weight tile, scales) and fixed bytes (kw - 1 float32 partial sums, the
    output tile), for ``mp`` padded rows."""
    per_stage = mp * bk * 2 + _WG_ROWS * (bk // 2) + (bk // BLOCK_SIZE) * _WG_ROWS * scale_itemsize
    fixed = (kw - 1) * _WG_ROWS * mp * 4 + mp * _WG_ROWS * out_itemsize
    return per_stage, fixed


def padded_rows(m: int, cfg: MgpuConfig | None = None) -> int:
    """x rows the kernel runs (the WGMMA N side): a multiple of 16, or 8 for M <= 8 with the
    one-kernel tiling (``k_split_wgs`` > 1: WGMMA takes N = 8), which halves the x tiles every CTA
    reads at token-generation sizes. ``cfg`` None: MgpuConfig() (as :func:`mgpu_w4a16`).
    Raises TypeError for a non-int ``m`` (bool included) or a ``cfg`` that is not an MgpuConfig,
    ValueError for ``m`` < 1."""
    cfg = MgpuConfig() if cfg is None else cfg
    if not isinstance(cfg, MgpuConfig):
        raise TypeError(f"padded_rows: cfg must be an MgpuConfig or None, got {type(cfg).__name__}")
    if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)):
        raise TypeError(f"padded_rows: m must be an int (activation rows), got {m!r}")
    if m < 1:
        raise ValueError(f"padded_rows: m must be >= 1, got {m}")
    if cfg.k_split_wgs > 1 and m <= 8:
        return 8
    return -(-m // 16) * 16


def _swizzle(row_bytes: int) -> int:
    """Largest TMA swizzle (bytes) that divides a tile row of ``row_bytes``."""
    for sw in (128, 64, 32):
        if row_bytes % sw == 0:
            return sw
    raise ValueError(f"tile rows of {row_bytes} bytes admit no swizzle (need a multiple of 32)")


def _ptx_fragment_order():
    """Column j of a decoded [64, 16] half-fragment (one block) <- byte ``order[j]`` of the
    block's 16 bytes, for the "ptx" decode: in Mosaic GPU's WGMMA_LAYOUT_8BIT each thread holds
    bytes 4g..4g+3 of a row's block (g = lane % 4) and the bf16 WGMMA A layout asks it for
    columns 2g, 2g+1 (register 0) and 8+2g, 8+2g+1 (register 1); the decode turns bytes
    4g, 4g+1 into register 0 and 4g+2, 4g+3 into register 1."""
    j = np.arange(BLOCK_SIZE // 2)
    return 4 * ((j % 8) // 2) + 2 * (j // 8) + j % 2


def split_x(x):
    """bfloat16 x [M, K] -> (x_lo, x_hi) [M, K/2]: the elements that meet the "ptx" decode's
    low- and high-nibble fragments, each block's 16 columns in :func:`_ptx_fragment_order` (a
    permutation of the contraction applied to both operands)."""
    m, k = x.shape
    # element 32b + 2p + n with byte p = 4g + 2ct + e (_ptx_fragment_order: column j = 8ct + 2g + e)
    xb = x.reshape(m, k // BLOCK_SIZE, 4, 2, 2, 2)  # (g, ct, e, nibble n)
    xb = jnp.transpose(xb, (0, 1, 3, 2, 4, 5))  # (ct, g, e, n)
    return xb[..., 0].reshape(m, k // 2), xb[..., 1].reshape(m, k // 2)


def _e8m0_pair(sb):
    """E8M0 byte (i32 MLIR value) -> the bfloat16x2 bits of 2^(b-127) in both lanes, the rule of
    mx_format.e8m0_to_bf16_bits (0x00 -> 2^-127, a bfloat16 subnormal; 0xFF -> NaN): one
    multiply places b << 7 in both 16-bit lanes, two selects for the two exceptions. Inside an
    ``inline_mgpu`` body only."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    bits = arith.muli(sb, arith.constant(i32, 0x00800080))
    bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, sb, arith.constant(i32, 0)),
                        arith.constant(i32, 0x00400040), bits)
    return arith.select(arith.cmpi(arith.CmpIPredicate.eq, sb, arith.constant(i32, 255)),
                        arith.constant(i32, 0x7FC07FC0), bits)


def _scale_byte(sref, row, b: int):
    """The E8M0 byte (i32 MLIR value) of weight row ``row`` (an index value) and block ``b`` from
    the K-major scales [nb, 64] in shared memory."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref

    blk = arith.constant(ir.IndexType.get(), b)
    return arith.extui(ir.IntegerType.get_signless(32), memref.load(sref, [blk, row]))


def _pair_registers(q, s2, asm: str) -> list:
    """The four bfloat16x2 registers that the pairs/"lanes" PTX ``asm`` of
    :mod:`jax_mxfp4.kernels.e2m1_asm` makes from a 32-bit weight word ``q`` and its bfloat16x2
    scale operand ``s2`` (i32 MLIR values; inside an ``inline_mgpu`` body)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [q, s2], asm, e2m1_asm.DECODE_PAIRS_CONSTRAINTS)
    return [mgpu.utils.bitcast(llvm.extractvalue(i32, res, [t]), bf2) for t in range(4)]


def _decode_folded(fa, sref, b0: int, b1: int, out, pairs_asm: bool = False, quad=None):
    """The "lanes" decode (``pairs_asm``: the pairs PTX, for the "natural" decode) of a thread's registers for blocks
    b0 <= b < b1 with the two bfloat16 multiplies folded into one where they can be
    (the one-kernel and the large-tile tilings): when every E8M0
    byte the thread reads here is <= ``e2m1_asm.FOLD_MAX_BYTE`` (scales <= 2, what trained weights
    have), one multiply by 2^(b-1) per output register (``e2m1_asm._DECODE_LANES_FOLD_PTX``),
    else the two-multiply form (x 2^126, x scale, :func:`_e8m0_pair`'s rule): one branch per
    warp (``scf.if`` on a ``vote.sync.all`` of the threads' tests: the fold only where every
    thread of the warp can take it, so a warp never runs both sides). ``quad``: None, or a
    function of a 32-bit word (an i32 MLIR value) applied to every word before the branch (the "natural" decode's
    quad transpose: warp shuffles, which every thread runs). Fills
    ``out`` (the numpy array of output registers of :func:`_decode_ptx`'s "pairs" form)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, scf

    i32 = ir.IntegerType.get_signless(32)
    bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
    regs = fa.registers
    items = []  # (output slot of register t = 0, the 32-bit word, the E8M0 byte as i32)
    for (row, _col), ridx in zip(fa.layout.thread_idxs(fa.shape), np.ndindex(regs.shape)):
        b, rh = ridx[1], ridx[4]
        if not b0 <= b < b1:
            continue
        q = mgpu.utils.bitcast(regs[ridx], i32)
        items.append(((4 * (b - b0), rh), quad(q) if quad else q, _scale_byte(sref, row, b)))
    top = items[0][2]
    for _, _, sb in items[1:]:
        top = arith.maxui(top, sb)
    small = arith.cmpi(arith.CmpIPredicate.ule, top, arith.constant(i32, e2m1_asm.FOLD_MAX_BYTE))
    # one side per warp (vote.sync.all): a warp whose threads disagreed would run both sides
    # (slower than never folding on the H200, docs/performance.md)
    voted = llvm.inline_asm(i32, [arith.extui(i32, small)], e2m1_asm.WARP_ALL_PTX, "=r,r")
    small = arith.cmpi(arith.CmpIPredicate.ne, voted, arith.constant(i32, 0))
    branch = scf.IfOp(small, [bf2] * (4 * len(items)), has_else=True)

    def side(fold: bool):
        vals = []
        for _, q, sb in items:
            if fold:  # 2^(b-1) = 2^126 x 2^(b-127): b x FOLD_SCALE_MUL + FOLD_SCALE_ADD
                s = arith.addi(arith.muli(sb, arith.constant(i32, e2m1_asm.FOLD_SCALE_MUL)),
                               arith.constant(i32, e2m1_asm.FOLD_SCALE_ADD))
                asm = e2m1_asm._DECODE_PAIRS_FOLD_PTX if pairs_asm else e2m1_asm._DECODE_LANES_FOLD_PTX
            else:
                s, asm = _e8m0_pair(sb), (e2m1_asm._DECODE_PAIRS_PTX if pairs_asm else e2m1_asm._DECODE_LANES_PTX)
            vals += _pair_registers(q, s, asm)
        scf.YieldOp(vals)

    with ir.InsertionPoint(branch.then_block):
        side(True)
    with ir.InsertionPoint(branch.else_block):
        side(False)
    results = list(branch.results)
    for j, ((col, rh), _, _) in enumerate(items):
        for t in range(4):
            out[0, col + t, 0, 0, rh, 0, 0, 0, 0] = results[4 * j + t]


def _decode_ptx(byt, s_ref, hb: int, pairs: bool = False, blocks: tuple[int, int] | None = None,
                lanes: bool = False, fold: bool = False, quad: bool = False):
    """Packed bytes uint8 [64, hb] (WGMMA_LAYOUT_8BIT) and the scale block, E8M0 bytes uint8
    [hb/16, 64] (shared memory) -> bfloat16 (lo, hi) [64, hb] in the WGMMA layout, by the inline PTX of
    :mod:`jax_mxfp4.kernels.e2m1_asm` (the same instructions the Triton kernel runs): one 32-bit
    register of 4 bytes -> 4 bfloat16x2 registers (low / high nibbles of bytes 0,1 and 2,3).
    ``pairs``: one bfloat16 [64, 2 hb] fragment instead, each byte -> one bfloat16x2 register
    (its two elements in order; ``e2m1_asm._DECODE_PAIRS_PTX``): byte t of a thread's register for
    block b fills fragment column group 4b + t (columns 32b + 8t + 2g, +1).
    ``blocks`` (``pairs`` only): decode only the 32-element blocks b0 <= b < b1 of the tile, as a
    [64, 32 (b1 - b0)] fragment (:attr:`MgpuConfig.chunks`: a tile decoded in parts, each part's
    WGMMAs issued before the next part is decoded).
    ``quad`` (``pairs`` with ``fold``: the large-tile kernel's "natural" decode): the bytes are in
    natural order; each 32-bit word is first moved to the "pairs" order across its quad of threads
    (``e2m1_asm.QUAD_TRANSPOSE_PTX``: two ``shfl.sync.bfly`` and two ``prmt``), so a plain
    MXFP4Array's bytes meet x as it is. Unfolded, ``pairs`` is the "lanes" decode only."""
    plgpu = _plgpu()
    nb = hb // (BLOCK_SIZE // 2)
    if pairs and not (lanes or (quad and fold)):
        raise ValueError("_decode_ptx: the pairs PTX runs only folded after the quad transpose (\"natural\" decode)")
    b0, b1 = (0, nb) if blocks is None else blocks
    if not pairs and (b0, b1) != (0, nb):
        raise ValueError("_decode_ptx: a block range needs the pairs decode")
    if fold and not pairs:
        raise ValueError("_decode_ptx: fold needs the one-fragment (pairs or lanes) decode")
    ret = plgpu.ShapeDtypeStruct((_WG_ROWS, hb), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
    rets = ((plgpu.ShapeDtypeStruct((_WG_ROWS, BLOCK_SIZE * (b1 - b0)), jnp.bfloat16, layout=plgpu.Layout.WGMMA),)
            if pairs else (ret, ret))

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.RefType()), return_type=rets)
    def decode(ctx, fa, sref):
        # sref: uint8 [nb, 64], the K-major E8M0 bytes
        del ctx
        import jax.experimental.mosaic.gpu as mgpu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        i32 = ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = fa.registers
        assert regs.shape == (1, nb, 1, 1, 2, 1, 1, 1, 1), regs.shape
        out_shape = (1, (4 if pairs else 2) * (b1 - b0), 1, 1, 2, 1, 1, 1, 1)
        lo = np.empty(out_shape, dtype=object)
        hi = np.empty(out_shape, dtype=object)
        struct = llvm.StructType.get_literal([i32] * 4)
        quad_fn = None
        if quad:  # this lane's two byte selectors, once per decode (e2m1_asm.QUAD_SELECTORS_PTX)
            sel = llvm.inline_asm(llvm.StructType.get_literal([i32] * 2), [], e2m1_asm.QUAD_SELECTORS_PTX,
                                  e2m1_asm.QUAD_SELECTORS_CONSTRAINTS)
            sel1, sel2 = (llvm.extractvalue(i32, sel, [j]) for j in range(2))
            # natural bytes -> "pairs" order across the quad (every thread runs it)
            quad_fn = lambda q: llvm.inline_asm(i32, [q, sel1, sel2], e2m1_asm.QUAD_TRANSPOSE_PTX,  # noqa: E731
                                                e2m1_asm.QUAD_TRANSPOSE_CONSTRAINTS, has_side_effects=True)
        if fold:
            _decode_folded(fa, sref, b0, b1, lo, pairs_asm=not lanes, quad=quad_fn)
            mk = lambda r: mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
            return (mk(lo),)
        for (row, _col), ridx in zip(fa.layout.thread_idxs(fa.shape), np.ndindex(regs.shape)):
            b, rh = ridx[1], ridx[4]
            if not b0 <= b < b1:
                continue
            s2 = _e8m0_pair(_scale_byte(sref, row, b))
            q = mgpu.utils.bitcast(regs[ridx], i32)
            if pairs:  # "lanes": the pairs PTX's outputs from bytes in lanes_order_bytes' nibble order
                for t, reg in enumerate(_pair_registers(q, s2, e2m1_asm._DECODE_LANES_PTX)):
                    lo[0, 4 * (b - b0) + t, 0, 0, rh, 0, 0, 0, 0] = reg
                continue
            res = llvm.inline_asm(struct, [q, s2, s2], e2m1_asm._DECODE_PTX, "=r,=r,=r,=r,r,r,r")
            outs = [mgpu.utils.bitcast(llvm.extractvalue(i32, res, [t]), bf2) for t in range(4)]
            for ct in range(2):
                lo[0, 2 * b + ct, 0, 0, rh, 0, 0, 0, 0] = outs[ct]
                hi[0, 2 * b + ct, 0, 0, rh, 0, 0, 0, 0] = outs[2 + ct]
        mk = lambda r: mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
        return (mk(lo),) if pairs else (mk(lo), mk(hi))

    out = decode(byt, s_ref)
    return out[0] if pairs else out


def _wgmma_step(x_refs, byt, s_ref, acc_ref, hb: int, decode: str, chunks: int = 1, fold: bool = False):
    """Decode one [64, hb] byte tile in registers and issue its WGMMAs ("ptx": ``lo @ x_lo^T +
    hi @ x_hi^T`` over the two halves of x; "lanes" and "natural": ``w @ x^T`` over x's [mp, 2 hb]
    tile). ``chunks`` (those two): the tile's blocks in that many parts, each part's WGMMAs issued (async)
    before the next part is decoded, so the tensor cores work while the next part decodes.
    ``fold`` (a one-fragment decode, E8M0 byte scales): :func:`_decode_folded`. Returns the number of
    WGMMA groups committed (for ``wgmma_wait``)."""
    plgpu = _plgpu()
    if decode in _PAIR_DECODES or decode == "natural":  # "natural": the pairs PTX after a quad transpose
        (x_ref,) = x_refs
        nb = hb // (BLOCK_SIZE // 2)
        per = nb // chunks
        for c in range(chunks):
            blocks = (c * per, (c + 1) * per) if chunks > 1 else None
            xc = x_ref.at[:, pl.ds(c * per * BLOCK_SIZE, per * BLOCK_SIZE)] if chunks > 1 else x_ref
            plgpu.wgmma(acc_ref, _decode_ptx(byt, s_ref, hb, pairs=True, blocks=blocks, lanes=decode == "lanes",
                                             fold=fold, quad=decode == "natural"),
                        plgpu.transpose_ref(xc, (1, 0)))
        return chunks
    xe_ref, xo_ref = x_refs
    lo, hi = _decode_ptx(byt, s_ref, hb)
    plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xe_ref, (1, 0)))
    plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xo_ref, (1, 0)))
    return 2


def _step(x_refs, w_ref, s_ref, acc_ref, cfg: MgpuConfig):
    """One K step of one warpgroup: decode the [64, bk/2] byte tile with its scales and
    accumulate into the WGMMA accumulator (waited for). ``x_refs``: (x,) for "lanes",
    else the two halves (x_lo, x_hi) of :func:`split_x`."""
    plgpu = _plgpu()
    _wgmma_step(x_refs, _load(w_ref, plgpu.Layout.WGMMA_8BIT), s_ref, acc_ref, cfg.bk // 2, cfg.decode)
    plgpu.wgmma_wait(0)


def check_2d_arrays(fn: str, items) -> None:
    """Each (name, value, what) of ``items`` must be an array (``shape`` and ``dtype``: TypeError)
    of rank 2 (ValueError), the message naming ``fn``, the argument and ``what`` it holds."""
    for name, v, what in items:
        if not hasattr(v, "shape") or not hasattr(v, "dtype"):
            raise TypeError(f"{fn}: {name} must be an array ({what}), got {type(v).__name__}")
        if len(v.shape) != 2:
            raise ValueError(f"{fn}: {name} must be 2-D ({what}), got shape {tuple(v.shape)}")


def _check_eager_device(x, fn: str = "mgpu_w4a16"):
    """RuntimeError for an eager call (concrete ``x``: a jax.Array, or a NumPy array, which runs on
    the default device) on a device that is not a GPU:
    Pallas would say "Only interpret mode is supported on CPU backend", which this kernel has not.
    Traced calls are checked when lowered. Called right before each launch, after the shape
    checks; ``fn`` names the kernel in the message."""
    if isinstance(x, (np.ndarray, np.generic)):  # a NumPy array runs on the default device
        where = [jax.default_backend()]
    else:
        try:
            where = sorted({d.platform for d in x.devices()})
        except Exception:  # a tracer (ConcretizationTypeError): checked when lowered
            return
    if any(p not in ("gpu", "cuda") for p in where):
        raise RuntimeError(
            f"{fn} runs only on an NVIDIA Hopper GPU (sm_90a, Mosaic GPU); x is on {', '.join(where)}. "
            "Use jax_mxfp4.dot_general (it routes here on such a GPU), or lower it for CUDA under jax.jit "
            "(jit(...).trace(...).lower(lowering_platforms=('cuda',)))"
        )


def _kernel_call(xs, w_data, scales, *, cfg: MgpuConfig, n: int, mp: int, stages: int, specs):
    """``plgpu.kernel`` launcher: one warpgroup per CTA, one CTA per (64-row tile, K split), the K
    steps through ``plgpu.emit_pipeline`` (TMA issued by the same warpgroup). ``xs``: the x
    operands of :func:`_step` (one for "lanes", two halves otherwise)."""
    plgpu = _plgpu()
    nt = n // _WG_ROWS
    nx = len(xs)
    kh_split = w_data.shape[1] // cfg.split_k
    kx_split = xs[0].shape[1] // cfg.split_k  # x columns per K split (K or K/2 per operand)
    nbs = kh_split // (BLOCK_SIZE // 2)
    steps = kh_split // (cfg.bk // 2)

    def body(*refs, out_smem):
        x_g, (w_g, s_g, out_g) = refs[:nx], refs[nx:]
        cta = lax.axis_index("cta")
        tile, sp = lax.rem(cta, nt), lax.div(cta, nt)

        def scope(acc_ref):
            def step(_, *srefs):
                _step(srefs[:nx], srefs[nx], srefs[nx + 1], acc_ref, cfg)

            ks = pl.ds(sp * kh_split, kh_split)
            xk = pl.ds(sp * kx_split, kx_split)
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=stages)(
                *[xg.at[:, xk] for xg in x_g], w_g.at[pl.ds(tile * _WG_ROWS, _WG_ROWS), ks],
                s_g.at[pl.ds(sp * nbs, nbs), pl.ds(tile * _WG_ROWS, _WG_ROWS)])
            out_smem[...] = acc_ref[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_g.at[pl.ds(sp * n + tile * _WG_ROWS, _WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.ACC((_WG_ROWS, mp), jnp.float32))

    _check_eager_device(xs[0])
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((cfg.split_k * n, mp), jnp.float32),
        grid=(nt * cfg.split_k,), grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=dict(out_smem=plgpu.SMEM((_WG_ROWS, mp), jnp.float32)),
    )
    return f(*xs, w_data, scales)


def _wg_k_slice(wg, bk: int, kw: int):
    """Compute warpgroup ``wg``'s share of one pipeline step under ``k_split_wgs = kw``: the
    (start, size) of its weight bytes per row, of its scale blocks and of its x columns, as
    offsets inside the step's tiles. Whole 32-element blocks, so the bytes, their scales and the
    x columns they meet are the same blocks in the "lanes" byte order (it permutes only inside a
    block). ``wg`` may be traced."""
    hbw, nbw, xw = bk // 2 // kw, bk // BLOCK_SIZE // kw, bk // kw
    return (wg * hbw, hbw), (wg * nbw, nbw), (wg * xw, xw)


def _k_split_call(x, w_data, scales, *, cfg: MgpuConfig, n: int, mp: int, out_dtype):
    """One kernel, final output: ``cfg.k_split_wgs`` (kw) compute warpgroups and one TMA warpgroup
    per CTA, one CTA per 64-row weight tile (grid N/64, no split-K across CTAs). Every pipeline
    step brings [64, bk/2] weight bytes, their [bk/32, 64] scales and x's [mp, bk] columns;
    compute warpgroup w decodes and multiplies its own slice
    (K columns w*bk/kw .. (w+1)*bk/kw of the step: bytes, scale blocks and x columns of the same
    32-blocks) into its own float32 accumulator [64, mp]. After the last step, warpgroups 1..kw-1
    store their accumulators to shared memory and arrive on one barrier (every thread arrives
    after its own stores: mbarrier arrive has release, the wait acquire semantics); warpgroup 0
    waits, adds them to its own in warpgroup order (a fixed order: deterministic), casts to
    ``out_dtype`` and stores the tile transposed (Mosaic GPU's WGMMA_TRANSPOSED layout into the
    transposed view of a swizzled [mp, 64] buffer), then one TMA store to out[:, tile]. The same
    barrier pattern as the schedule barrier of jax's attention_mgpu.py (num_arrivals = the
    warpgroups that arrive). Returns ``out_dtype`` [mp, N].

    ``x`` may have fewer rows than ``mp`` (fewer than 8, or a multiple of 8: Mosaic GPU's TMA
    tiling): the TMA copies read a box of ``mp`` rows, and the hardware fills rows past the
    array's end with zeros (and the output's TMA store writes none past it), so the call needs no
    pad of x and no slice of the result (each a separate kernel per call, docs/performance.md);
    the output then has ``x``'s rows. The pipeline
    (:func:`_k_split_own_pipeline`): ``stages`` shared-memory slots; step t uses slot t % stages; ready[slot] completes when
    the slot's TMA copies have landed (every compute warpgroup waits on it), consumed[slot] when
    all kw compute warpgroups have finished reading it (each arrives once per step, after its
    WGMMAs were waited for), and the TMA warpgroup waits on it before refilling the slot."""
    plgpu = _plgpu()
    kw = cfg.k_split_wgs
    k_half = w_data.shape[1]
    hb, nb = cfg.bk // 2, cfg.bk // BLOCK_SIZE
    steps = k_half // hb
    nt = n // _WG_ROWS
    (_, hbw), _, (_, xw) = _wg_k_slice(0, cfg.bk, kw)  # one warpgroup's bytes per row, x columns
    # swizzle tiles no wider than one warpgroup's slice
    x_tr, w_tr = _tiled(_swizzle(xw * 2), 2), _tiled(_swizzle(hbw), 1)
    # the transposed store of the output tile, as jax's own tests of it run (tests/pallas/
    # mosaic_gpu_test.py): 16-bit into a (8, 64)-tiled 128-byte-swizzled buffer
    # (test_transposed_layout), float32 into a plain one (test_transposed_load_store)
    osize = jnp.dtype(out_dtype).itemsize
    o_tr = _tiled(128, 2) if osize == 2 else ()
    per_stage, fixed = _k_split_smem(mp, cfg.bk, kw, osize, jnp.dtype(scales.dtype).itemsize)
    stages = _ws_stages(cfg, steps, per_stage, fixed, f"k_split_wgs={kw} with bk={cfg.bk}, K={2 * k_half} and "
                        f"{mp} padded rows")

    def mma(wg, x_s, w_s, s_s, acc_ref):
        """Compute warpgroup ``wg``'s slice of one step (tiles of one slot), waited for."""
        (b0, bn), (s0, sn), (x0, xn) = _wg_k_slice(wg, cfg.bk, kw)
        x_w = (x_s.at[:, pl.ds(x0, xn)],)
        byt = _load(w_s.at[:, pl.ds(b0, bn)], plgpu.Layout.WGMMA_8BIT)
        _wgmma_step(x_w, byt, s_s.at[pl.ds(s0, sn)], acc_ref, bn, cfg.decode, chunks=cfg.chunks, fold=True)
        plgpu.wgmma_wait(0)

    def finish(wg, acc, part_smem, o_smem, sum_bar, out_g, tile):
        """The partial sums of warpgroups 1..kw-1 into warpgroup 0's, in order; its TMA store."""
        @pl.when(wg > 0)
        def _():
            part_smem[wg - 1] = acc
            plgpu.barrier_arrive(sum_bar)

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(sum_bar)
            total = acc
            for j in range(kw - 1):  # warpgroup order: a fixed summation order
                total = total + _load(part_smem.at[j], plgpu.Layout.WGMMA, optimized=False)
            out_t = plgpu.layout_cast(total.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(o_smem.at[:, :], (1, 0))[...] = out_t  # .at: jax 0.11 transposes TransformedRefs only
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_g.at[pl.ds(0, mp), pl.ds(tile * _WG_ROWS, _WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

    scratch = dict(part_smem=plgpu.SMEM((kw - 1, _WG_ROWS, mp), jnp.float32),
                   o_smem=plgpu.SMEM((mp, _WG_ROWS), out_dtype, transforms=o_tr),
                   sum_bar=plgpu.Barrier(num_arrivals=kw - 1),
                   x_smem=plgpu.SMEM((stages, mp, cfg.bk), jnp.bfloat16, transforms=x_tr),
                   w_smem=plgpu.SMEM((stages, _WG_ROWS, hb), jnp.uint8, transforms=w_tr),
                   s_smem=plgpu.SMEM((stages, nb, _WG_ROWS), scales.dtype),
                   ready=plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # one arrival per TMA copy
                   consumed=plgpu.Barrier(num_arrivals=kw, num_barriers=stages))  # one per compute warpgroup

    def body(x_g, w_g, s_g, out_g, part_smem, o_smem, sum_bar, x_smem, w_smem, s_smem, ready, consumed):
        tile = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        rows = pl.ds(tile * _WG_ROWS, _WG_ROWS)

        def fetch(t, slot):  # step t's tiles into ``slot``, each copy arriving on ready[slot]
            plgpu.copy_gmem_to_smem(x_g.at[pl.ds(0, mp), pl.ds(t * cfg.bk, cfg.bk)], x_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(w_g.at[rows, pl.ds(t * hb, hb)], w_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(s_g.at[pl.ds(t * nb, nb), rows], s_smem.at[slot], ready.at[slot])

        def step(slot, acc_ref):
            mma(wg, x_smem.at[slot], w_smem.at[slot], s_smem.at[slot], acc_ref)

        def compute_context(run):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_WG_ROWS, mp), jnp.float32))
            def _(acc_ref):
                run(acc_ref)
                finish(wg, acc_ref[...], part_smem, o_smem, sum_bar, out_g, tile)

        _k_split_own_pipeline(wg, kw, steps, stages, fetch=fetch, step=step, ready=ready, consumed=consumed,
                              compute_context=compute_context)

    _check_eager_device(x)
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((x.shape[0], n), out_dtype),
        grid=(nt,), grid_names=("cta",),
        num_threads=kw + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=scratch,
    )
    return f(x, w_data, scales)


def _k_split_own_pipeline(wg, kw: int, steps: int, stages: int, *, fetch, step, ready, consumed, compute_context,
                          registers: tuple[int, int] | None = None):
    """The warp-specialized pipeline of :func:`_k_split_call`: the schedule of
    ``plgpu.emit_pipeline_warp_specialized`` (jax 0.11, automatic barriers, no delay_release)
    without its ``setmaxnreg``, which deadlocks with 4 compute warpgroups: it asks per compute
    thread ``floor8((512 - 40) / kw)`` registers (jax's ``_compute_registers``, which assumes the
    whole 64K register file is the CTA's pool), but a CTA of ``128 (kw + 1)`` threads is launched
    with at most ``floor8(65536 / threads)`` per thread, and ``setmaxnreg.inc`` blocks until the
    CTA's pool has them (PTX ISA, setmaxnreg): 4 warpgroups ask 128 (40 + 4 x 112) = 62464 of 640
    x 96 = 61440, so the 4th waits forever (:func:`_ws_register_demand`). Here every warpgroup
    keeps the registers it is launched with
    (ptxas: <= floor8(65536 / (128 (kw + 1))) per thread, 96 for kw = 4, 168 for kw = 2; a compute
    thread holds mp/2 accumulator registers and its decoded slice).

    ``wg``: this warpgroup (0..kw-1 compute, kw the TMA warpgroup); ``stages`` <= ``steps`` slots;
    ``ready`` / ``consumed``: Barrier arrays of ``stages`` (num_arrivals: the TMA copies per step /
    ``kw``). Warpgroup kw: ``fetch(t, slot)`` (issue step t's TMA copies into ``slot``, arriving
    on ready[slot]) for the first ``stages`` steps; then for each step t >= stages it waits
    consumed[t % stages] (step t - stages was read by every compute warpgroup) and fetches step
    t into that slot; at the end it waits the last ``stages`` consumed phases, so every phase of
    every barrier is waited once by every waiting thread, in order (Mosaic GPU keeps the parity
    per thread). Warpgroups 0..kw-1: ``compute_context(run)``, which calls ``run(carry)`` once;
    ``run`` does, per step t: wait ready[t % stages], ``step(slot, carry)`` (its reads of the slot
    finished when it returns), arrive on consumed[t % stages].
    ``registers`` (memory, compute): per-thread registers the TMA warpgroup gives up and each
    compute warpgroup asks for first (``setmaxnreg``); the caller keeps ``128 (memory + kw
    compute)`` within the CTA's pool (:func:`_ws_register_demand`'s rule: ``setmaxnreg.inc``
    waits forever otherwise); None: no reallocation."""
    plgpu = _plgpu()
    if registers is not None:
        need, pool = 128 * (registers[0] + kw * registers[1]), _ws_register_demand(kw, 0)[1]
        if need > pool:
            raise ValueError(f"_k_split_own_pipeline: registers={registers} ask {need} of the {pool} a CTA of "
                             f"{128 * (kw + 1)} threads is launched with (setmaxnreg.inc would wait forever)")

    @pl.when(wg == kw)
    def _memory():
        if registers is not None:
            plgpu.set_max_registers(registers[0], action="decrease")
        for t in range(stages):  # prologue: stages <= steps (_ws_stages)
            fetch(t, t)

        @pl.loop(stages, steps)
        def _(t):
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(consumed.at[slot])
            fetch(t, slot)

        @pl.loop(steps - stages, steps)  # quiesce: the last stages steps' releases
        def _(t):
            plgpu.barrier_wait(consumed.at[lax.rem(t, stages)])

    @pl.when(wg < kw)
    def _compute():
        if registers is not None:
            plgpu.set_max_registers(registers[1], action="increase")

        def run(carry):
            @pl.loop(0, steps)
            def _(t):
                slot = lax.rem(t, stages)
                plgpu.barrier_wait(ready.at[slot])
                step(slot, carry)
                plgpu.barrier_arrive(consumed.at[slot])

        compute_context(run)


SCALE_FORMS = ("rows", "kmajor")


def mgpu_w4a16(x, w_data, w_scales, out_dtype=jnp.bfloat16, cfg: MgpuConfig | None = None,
               *, scales_form: str = "rows", w_order: str = "natural"):
    """``x · Wᵀ`` for bfloat16 x [M, K] and MXFP4 W -> [M, N] of ``out_dtype`` (float32 accumulation).

    Args:
      x: bfloat16 [M, K], M <= 256 (activation rows; padded to a multiple of 16 inside).
      w_data: uint8 [N, K/2] packed E2M1 (element 2j in the low nibble of byte j); N % 64 == 0.
      w_scales: E8M0 scale bytes as ``scales_form`` says: "rows" uint8 [N, K/32] (the plain layout;
        transposed to "kmajor" per call, one small XLA transpose), "kmajor" uint8 [K/32, N] (the
        kernel's own layout: read by TMA and converted to bfloat16 in registers, no per-call
        work; what :func:`jax_mxfp4.prepare_decode` stores). Both also take the same bytes as
        ``float8_e8m0fnu`` (e.g. ``DecodePrepared.scales``; a bitcast).
      out_dtype: float32, bfloat16 or float16. cfg: :class:`MgpuConfig` (default MgpuConfig();
        dispatch passes :func:`default_mgpu_config` of the shape and byte order).
      w_order: byte order of ``w_data``: "natural" (byte j = elements 2j, 2j+1; the "ptx"
        decode) or "lanes" (:func:`jax_mxfp4.decode_prepared.lanes_order_bytes` of
        :func:`jax_mxfp4.decode_prepared.pair_order_bytes`, what :func:`jax_mxfp4.prepare_decode` stores by default): read
        by the "lanes" decode only, and only it reads them.
    Runs only on an NVIDIA Hopper GPU (sm_90a) through Mosaic GPU.
    Raises:
      TypeError: ``cfg`` not an MgpuConfig; ``x``, ``w_data`` or ``w_scales`` not arrays.
      RuntimeError: called eagerly with ``x`` on a device other than a GPU (traced calls are
        checked when lowered: Pallas refuses other platforms).
      ValueError: ranks, shapes, dtypes (``out_dtype`` included), K = 0, a K that is not a
        multiple of ``cfg.bk * cfg.split_k``, an unknown ``w_order``, "lanes" bytes and the
        "lanes" decode not paired with each other; ``cfg.k_split_wgs`` > 1 with fewer than two K steps or without shared memory for
        two pipeline stages.
    With ``cfg.k_split_wgs`` > 1 the kernel writes the result itself (``[M, N]`` of
    ``out_dtype``; sliced to M rows afterwards when M is not the padded row count, :func:`padded_rows`): one kernel per
    call for "kmajor" scales and x rows already padded (:func:`padded_rows`; "rows" scales add
    their per-call transpose).
    """
    cfg = MgpuConfig() if cfg is None else cfg
    if not isinstance(cfg, MgpuConfig):
        raise TypeError(f"mgpu_w4a16: cfg must be an MgpuConfig or None, got {type(cfg).__name__}")
    check_2d_arrays("mgpu_w4a16", (("x", x, "bfloat16 [M, K]"), ("w_data", w_data, "uint8 [N, K/2]"),
                                   ("w_scales", w_scales, "the E8M0 scales, 2-D")))
    out_dtype = check_output_dtype(out_dtype, "mgpu_w4a16: out_dtype")
    m, k = x.shape
    n, half_k = w_data.shape
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"mgpu_w4a16: x must be bfloat16, got {x.dtype}")
    if w_data.dtype != jnp.uint8 or half_k * 2 != k:
        raise ValueError(f"mgpu_w4a16: w_data must be uint8 [N, K/2] with K={k}, got "
                         f"{w_data.dtype} {w_data.shape}")
    if k == 0:
        raise ValueError("mgpu_w4a16: K must be > 0 (an empty contraction is an exact zero: no kernel to run)")
    if w_order not in W_ORDERS:
        raise ValueError(f"mgpu_w4a16: w_order must be one of {W_ORDERS}, got {w_order!r}")
    if (w_order == "lanes") != (cfg.decode == "lanes"):
        raise ValueError(f'mgpu_w4a16: the "lanes" decode reads w_order="lanes" bytes only (and they need it), got '
                         f"w_order={w_order!r} with decode={cfg.decode!r}")
    if scales_form not in SCALE_FORMS:
        raise ValueError(f"mgpu_w4a16: scales_form must be one of {SCALE_FORMS}, got {scales_form!r}")
    if w_scales.dtype == jnp.float8_e8m0fnu:
        w_scales = as_scale_bytes(w_scales)  # the same bytes (what prepare_decode stores)
    sshape = (n, k // BLOCK_SIZE) if scales_form == "rows" else (k // BLOCK_SIZE, n)
    if w_scales.shape != sshape or w_scales.dtype != jnp.uint8:
        raise ValueError(f"mgpu_w4a16: w_scales ({scales_form!r}) must be uint8 {sshape}, "
                         f"got {w_scales.dtype} {w_scales.shape}")
    if n % _WG_ROWS:
        raise ValueError(f"mgpu_w4a16: N={n} must be a multiple of {_WG_ROWS}")
    if not 1 <= m <= 256:
        raise ValueError(f"mgpu_w4a16: M={m} must be in [1, 256] (decode sizes)")
    if k % (cfg.bk * cfg.split_k):
        raise ValueError(f"mgpu_w4a16: K={k} is not a multiple of bk*split_k={cfg.bk * cfg.split_k}")
    plgpu = _plgpu()
    scales = w_scales.T if scales_form == "rows" else w_scales
    mp = padded_rows(m, cfg)
    # the one-kernel route takes x and writes out unpadded where Mosaic GPU's TMA takes their rows
    # (fewer than its 8-row tile, or whole tiles): TMA reads rows past M as zeros and stores none
    as_is = cfg.k_split_wgs > 1 and (m < 8 or m % 8 == 0)
    xp = x if as_is or mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    if cfg.k_split_wgs > 1:  # one kernel, its output final: no sum, transpose or cast after it
        out = _k_split_call(xp, w_data, scales, cfg=cfg, n=n, mp=mp, out_dtype=out_dtype)
        return out if out.shape[0] == m else out[:m]
    xs = (xp,) if cfg.decode in _PAIR_DECODES else split_x(xp)  # "lanes" bytes meet x as it is
    steps = k // (cfg.bk * cfg.split_k)
    hb = cfg.bk // 2
    xcols = cfg.bk // len(xs)  # x columns per step and operand
    x_tr, w_tr = _tiled(_swizzle(xcols * 2), 2), _tiled(_swizzle(hb), 1)
    # shared memory: x halves, weight bytes and scales per stage, the output block (x2) below the
    # H100/H200 limit of 227 KiB
    per_stage = 2 * mp * hb * 2 + _WG_ROWS * hb + (cfg.bk // BLOCK_SIZE) * _WG_ROWS
    fit = max(1, (_SMEM_BUDGET - 2 * _WG_ROWS * mp * 4) // per_stage)
    stages = max(1, min(cfg.stages, steps, fit))
    specs = [plgpu.BlockSpec((mp, xcols), lambda t: (0, t), transforms=x_tr)] * len(xs) + [
             plgpu.BlockSpec((_WG_ROWS, hb), lambda t: (0, t), transforms=w_tr),
             plgpu.BlockSpec((cfg.bk // BLOCK_SIZE, _WG_ROWS), lambda t: (t, 0))]
    out = _kernel_call(xs, w_data, scales, cfg=cfg, n=n, mp=mp, stages=stages, specs=specs)
    out = out.reshape(cfg.split_k, n, mp).sum(axis=0)
    return out[:, :m].T.astype(out_dtype)


def _check_config_args(fn: str, m, n, k, w_order) -> None:
    """The arguments of the tiling choosers: ``m``, ``n``, ``k`` ints (not bool; numpy integers
    too), M and N >= 1, K a positive multiple of 64, ``w_order`` one of :data:`W_ORDERS`.
    TypeError / ValueError naming the argument and the rule (the other shape rules of the kernel,
    M <= 64 and N % 64: :func:`unsupported_reason`)."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{fn}: {name} must be an int, got {v!r}")
    if m < 1 or n < 1:
        raise ValueError(f"{fn}: M and N must be >= 1, got m={m}, n={n}")
    if k <= 0 or k % (2 * BLOCK_SIZE):
        raise ValueError(f"{fn}: K={k} must be a positive multiple of {2 * BLOCK_SIZE} "
                         "(unsupported_reason says so before dispatch asks)")
    if not isinstance(w_order, str) or w_order not in W_ORDERS:
        raise ValueError(f"{fn}: w_order must be one of {W_ORDERS}, got {w_order!r}")


def default_mgpu_config(m: int, n: int, k: int, w_order: str = "natural") -> MgpuConfig:
    """Tiling by shape and the weight's byte order, from H200 timing runs of each tiling
    (docs/performance.md). "lanes" bytes (prepared weights) take the one-kernel tiling with 4
    compute warpgroups where it applies (:func:`k_split_config`: fastest at decode sizes), else the
    split-K kernel with the "lanes" decode (x read as it is). Natural bytes take the split-K kernel
    with the "ptx" decode: its x split (one XLA fusion) is cheaper than permuting x per call for a
    one-fragment decode. Split-K: one warpgroup per CTA, bk 256, split-K 4, each halved until
    they divide K.

    Args: ``m`` activation rows, ``n`` weight rows, ``k`` the contraction ([m, k] x [n, k]).
    Raises:
      TypeError: ``m``, ``n`` or ``k`` not an int (bool included).
      ValueError: ``m`` or ``n`` < 1; ``k`` not a positive multiple of 64; ``w_order`` not one
        of :data:`W_ORDERS`. (M > 64 and N % 64 are :func:`unsupported_reason`'s to report.)"""
    _check_config_args("default_mgpu_config", m, n, k, w_order)
    if w_order == "lanes":
        one_kernel = k_split_config(m, n, k)
        if one_kernel is not None:
            return one_kernel
    bk, split = 256, 4
    while k % (bk * split):
        if split > 1:
            split //= 2
        else:
            bk //= 2
    decode = w_order if w_order in _PAIR_DECODES else "ptx"
    return MgpuConfig(bk=bk, split_k=split, stages=4, decode=decode)


def k_split_config(m: int, n: int, k: int) -> MgpuConfig | None:
    """The one-kernel tiling (:attr:`MgpuConfig.k_split_wgs` 4, "lanes" decode) for a shape, or
    None where it does not apply: bk 512, else 256, the largest that divides K in at least two
    steps (each warpgroup's slice whole 64-element swizzle tiles), where two pipeline stages fit
    in shared memory for ``m`` rows (padded to 16); stages 5 (lowered where shared memory is
    short); each slice decoded in two parts where both are whole x swizzle tiles (faster on the
    H200, docs/performance.md).

    Raises:
      TypeError / ValueError: ``m``, ``n`` or ``k`` as :func:`default_mgpu_config`."""
    _check_config_args("k_split_config", m, n, k, "lanes")
    kw = K_SPLIT_WGS[-1]
    mp = -(-max(m, 1) // 16) * 16
    for bk in (512, 256):
        # float32 output (the largest) and 2 bytes per scale (a margin: the tilings stay those measured)
        per_stage, fixed = _k_split_smem(mp, bk, kw, 4, 2)
        if (bk % (kw * _K_SLICE_MIN) == 0 and k % bk == 0 and k // bk >= 2
                and _SMEM_BUDGET - fixed >= 2 * per_stage):
            chunks = 2 if (bk // kw) % (2 * _K_SLICE_MIN) == 0 else 1
            return MgpuConfig(bk=bk, split_k=1, stages=5, decode="lanes", k_split_wgs=kw, chunks=chunks)
    return None


def unsupported_reason(m: int, n: int, k: int) -> str | None:
    """None if :func:`mgpu_w4a16` with :func:`default_mgpu_config` takes [m, k] x [n, k], else why
    not (shape rules of the kernel; the device check is the caller's)."""
    if m > 64:
        return f"M={m} > 64 activation rows (measured on the H200 up to 40 rows checked, 16 timed)"
    if n % _WG_ROWS:
        return f"N={n} is not a multiple of {_WG_ROWS} weight rows"
    if k % (2 * BLOCK_SIZE):
        return f"K={k} is not a multiple of {2 * BLOCK_SIZE}"
    return None
