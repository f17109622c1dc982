"""Weight-stationary w4a16 MXFP4 GEMM in Pallas Mosaic GPU (NVIDIA Hopper, WGMMA).

Computes ``out = x · Wᵀ`` for a bfloat16 activation x [M, K] (M <= 256, decode sizes) and an
MXFP4 weight W (packed E2M1 bytes [N, K/2], E8M0 scale bytes [N, K/32]) as ``outᵀ = W · xᵀ``:
the weight's rows are the WGMMA M side (64 rows per warpgroup) and its decoded tile is the
REGISTER A operand; the activation rows (padded to a multiple of 16, or to 8: :func:`padded_rows`) are the WGMMA N side, read
from shared memory as the B operand. Per K step the weight bytes, the scales and the two halves of
x arrive by TMA; the bytes are loaded into registers and decoded there:

- low nibble of byte j = element 2j, high nibble = element 2j+1; a contraction may be permuted
  identically on both operands, so each decoded half (low nibbles, high nibbles) meets its own
  half of x (:func:`split_x`, done once per call on the small activation): two WGMMAs per step;
- ``decode="ptx"`` (the fast one): the bytes load in Mosaic GPU's 8-bit WGMMA register layout
  (each thread holds 4 bytes of a row's 32-element block), and the inline PTX of
  :mod:`jax_mxfp4.kernels.e2m1_asm` (Marlin-style lanes; the Triton kernel runs the same
  instructions) turns each 32-bit register into the four bfloat16x2 registers of the thread's A
  fragment slots, block scale applied last; x's columns follow :func:`_ptx_fragment_order`;
- ``decode="pairs"`` (since 2026-12-01): the same byte loads and scale, but each byte becomes one
  bfloat16x2 register holding its two elements in order (``e2m1_asm._DECODE_PAIRS_PTX``), so the
  decoded tile is ONE [64, bk] fragment whose K columns are x's natural columns when the weight
  bytes are stored in the "pairs" order (:func:`pair_order_bytes`: a 4x4 byte transpose inside
  every 16-byte block, done once by :func:`jax_mxfp4.prepare_decode`); one x tile and one WGMMA
  per step, no per-call work on x. Natural-order bytes work too, with x permuted per call
  (:func:`permute_x_pairs`);
- ``decode="lanes"`` (since 2026-12-01, the default for prepared weights): the "pairs"
  decode's outputs from weight bytes whose 32-bit words have their nibbles regrouped by bfloat16
  lane (:func:`jax_mxfp4.decode_prepared.lanes_order_bytes`, what :func:`jax_mxfp4.prepare_decode`
  stores by default): a mask and one multiply per output register (``e2m1_asm._DECODE_LANES_PTX``)
  instead of a byte permute and two shifts. The kernel is compute-bound (NVIDIA H200, jax 0.11.2,
  2026-12-01, 16x8192x8192: 11.8 us of data movement vs 20.3 us whole with "pairs"); "lanes"
  18.3 us, decoded in two parts (:attr:`MgpuConfig.chunks`) 17.8;
- ``decode="mul"`` / ``"select"`` (portable Pallas operations, one 32-element block at a time):
  E2M1 code c -> bfloat16 bits ``sign << 15 | (c & 7) << 6`` = value x 2^-126, times 2^126
  (``"mul"``; the E2M1 0.5 passes through a bfloat16 subnormal), or ``(c & 7) << 6 + 0x3F00``
  with selects for codes 0 and 1 (``"select"``); source: the Marlin FP4 decode (vllm
  csrc/quantization/marlin/dequant.h); checked in NumPy on every byte (tests/test_wgemm_mgpu.py);
- the block scale 2^(b-127) is the bfloat16 of :func:`jax_mxfp4.mx_format.e8m0_to_bf16_bits`
  (byte 0 the subnormal 2^-127, 0xFF NaN), applied last: E2M1 x scale is exact in bfloat16, its
  products with x exact in float32, WGMMA accumulates in float32; results equal backend "xla" up
  to the order of float32 accumulation.

Launchers (:class:`MgpuConfig`): ``pallas_call`` with a pipelined grid, ``plgpu.kernel`` +
``emit_pipeline`` (one warpgroup per CTA), or warp-specialized (two compute warpgroups, one TMA
warpgroup; optionally reading the E8M0 bytes as stored). Split-K over the grid fills the GPU when
N/64 tiles are few; float32 partial sums are added afterwards in a fixed order. Otherwise the
scales arrive as E8M0 bytes in a K-major [K/32, N] layout by TMA and are converted to bfloat16
in registers (``scales_form``; :func:`jax_mxfp4.prepare_decode` stores weights that way).
``k_split_wgs`` (checked and timed on the H200, 2026-12-01, and the dispatch default for
"pairs" bytes with 4 warpgroups: :func:`default_mgpu_config`): ONE kernel per call instead of the kernel
plus XLA's split-K sum/transpose/cast (each extra kernel costs ~4-5 us of launch gap at decode
sizes): the warp-specialized CTA's compute warpgroups share one 64-row tile and split each K
step between them, warpgroup 0 adds their partial sums in a fixed order and stores the final
``[mp, N]`` tile of ``out_dtype`` transposed, by TMA (:func:`_k_split_call`). With jax 0.11.2's
pipeline it hangs on the H200 with 4 compute warpgroups: jax's ``emit_pipeline_warp_specialized`` asks for
more registers than the CTA is launched with (MgpuConfig.k_split_pipeline); it now runs its own
pipeline (:func:`_k_split_own_pipeline`) without register reallocation.

Status: every variant lowers for CUDA on a CPU machine (tests/test_wgemm_mgpu.py). On the H200
(jax 0.11.2) the ``plgpu.kernel`` launchers are correct, ``raw_scales`` too
(tests/gpu/test_gpu_wgemm_mgpu.py); through ``dot_general`` with a prepared weight 16x8192x8192
runs at 0.71x of bf16 and 1x8192x8192 at 0.84x (2026-12-01, the 4-warpgroup one-kernel tiling);
the ``pallas_call`` launcher of the split-K kernel fails
in jax 0.11.2's lowering (bare AssertionError). Dispatch takes it for decode-size w4a16 and a4w4
on Hopper (``jax_mxfp4.backends.pallas.W4A16_MOSAIC_GPU``).
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
from ..decode_prepared import pair_order_bytes
from ..mx_format import BLOCK_SIZE, as_scale_bytes, e8m0_to_bf16_bits
from . import e2m1_asm

DECODES = ("mul", "select", "ptx", "pairs", "lanes")
_PTX_DECODES = ("ptx", "pairs", "lanes")  # the decodes that load bytes in WGMMA_LAYOUT_8BIT and run inline PTX
_PAIR_DECODES = ("pairs", "lanes")  # one bfloat16x2 register per two elements in order: x read as it is
W_ORDERS = ("natural", "pairs", "lanes")  # byte order of the packed weight (pair_order_bytes, lanes_order_bytes)
_WG_ROWS = 64  # rows of one warpgroup's WGMMA tile (M side)
_BF16_2P126 = 0x7E80  # bfloat16 bits of 2^126
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipeline may take (sm_90: 227 KiB)
K_SPLIT_WGS = (1, 2, 4)  # MgpuConfig.k_split_wgs: compute warpgroups sharing one 64-row tile's K steps
_K_SLICE_MIN = 64  # K elements of one warpgroup's slice of a step: 32 weight bytes, 128 bytes of x
K_SPLIT_PIPELINES = ("own", "jax")  # MgpuConfig.k_split_pipeline
CLUSTERS = (1, 2, 4)  # MgpuConfig.cluster: CTAs of one cluster sharing each x tile by TMA multicast
_MEMORY_REGISTERS = 40  # per-thread registers of the TMA warpgroup (memory_registers) in emit_pipeline_warp_specialized


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
    """Tiling of the Mosaic GPU w4a16 kernel.

    bk: K elements per pipeline step (multiple of 32, divides K / split_k); split_k: K ranges
    summed afterwards; stages: pipeline depth (``max_concurrent_steps``; lowered where shared
    memory would not fit); decode: ``"lanes"``, ``"pairs"``, ``"ptx"``, ``"mul"`` or ``"select"`` (module doc); x_swizzle: shared-memory swizzle of x's tiles in bytes (32: each
    16-element block is one tile); warp_specialized: ``plgpu.kernel`` with two compute warpgroups
    (128 weight rows per CTA) fed by a TMA warpgroup (``emit_pipeline_warp_specialized``) instead
    of the one-warpgroup ``pallas_call`` pipeline ("ptx"/"pairs" decodes only); raw_scales (warp_specialized
    only): the kernel reads the E8M0 bytes [N, K/32] as stored (each CTA copies its [128, K/32 /
    split_k] slab into shared memory once) and converts them in registers, instead of taking the
    bfloat16 [K/32, N] form that :func:`kernel_scales` builds outside; launcher (without
    warp_specialized): ``"pallas_call"`` (grid pipelined by Pallas) or ``"kernel"``
    (``plgpu.kernel`` + ``plgpu.emit_pipeline``, the API jax 0.11 recommends).
    k_split_wgs (2 or 4; 1 = off): ONE kernel per call, writing the final ``[M, N]`` output of
    ``out_dtype`` itself (no split-K sum, transpose or cast after it): each CTA owns 64 weight
    rows and the whole K range (grid N/64, ``split_k`` must be 1); its ``k_split_wgs`` compute
    warpgroups each take their own 1/k_split_wgs slice of every pipeline step's K columns
    (``bk / k_split_wgs`` must be a multiple of 64, so each slice is whole swizzle tiles of the
    weight bytes and of x), and their float32 partial sums are added in warpgroup order by
    warpgroup 0, which stores the transposed ``[mp, 64]`` tile by TMA (:func:`_k_split_call`).
    Needs ``warp_specialized=True``, decode "pairs" or "ptx", no ``raw_scales``.
    k_split_pipeline (k_split_wgs > 1 only): ``"own"`` (default) = this module's warp-specialized
    pipeline (:func:`_k_split_call`: TMA warpgroup, ready/consumed barriers per stage, NO register
    reallocation), or ``"jax"`` = ``plgpu.emit_pipeline_warp_specialized``, kept for comparison and
    for 2 compute warpgroups only: it always runs ``setmaxnreg``, asking per compute thread
    ``floor8((512 - 40) / k_split_wgs)`` registers (jax's ``_compute_registers``, which assumes the
    whole 64K register file is the CTA's pool), but a CTA of ``128 (k_split_wgs + 1)`` threads is
    launched with at most ``floor8(65536 / threads)`` registers per thread, and ``setmaxnreg.inc``
    blocks until the CTA's pool has the registers (PTX ISA, setmaxnreg): 2 warpgroups ask
    128 (40 + 2 x 232) = 64512 of a pool of 384 x 168 = 64512 (fits exactly); 4 ask 128 (40 +
    4 x 112) = 62464 of 640 x 96 = 61440, so the 4th compute warpgroup waits forever (the hang of
    the 2026-12-01 H200 run), whatever K is; no ``memory_registers`` value fits (:func:`_ws_register_demand`).
    cluster (one-kernel tiling, "own" pipeline): 1, 2 or 4 CTAs per cluster sharing each x tile by
    TMA multicast (each issues a part; the consumed barrier spans the cluster), N/64 a multiple of
    it and x's tile splittable (:func:`multicast_splits`); measured no faster (NVIDIA H200, jax 0.11.2, 2026-12-01).
    tile_major (same tiling): the weight bytes and K-major scale bytes are given in
    :func:`tile_major_layout`'s order for this ``bk`` (one contiguous block per CTA and step);
    measured 2% faster at most, not a default. chunks (same tiling, "pairs"/"lanes"
    decodes): each warpgroup decodes its slice of a step in this many parts, issuing each part's
    WGMMAs before decoding the next (parts of whole 64-element x swizzle tiles);
    :func:`k_split_config` takes 2 where allowed.
    fold_scale ("lanes" decode, one-kernel tiling, E8M0 byte scales): x 2^126 and x scale as one
    bfloat16x2 multiply by 2^(b-1) wherever every thread of a warp has all its E8M0 bytes of the
    decoded part (a step, or a part of it with ``chunks``) <= 128 (scales <= 2; one
    ``vote.sync.all`` per warp), the two-multiply form otherwise (:func:`_decode_folded`);
    same bits. Not with ``delay_release`` (wrong results on the H200 at 2 warpgroups, jax 0.11.2).
    delay_release (one-kernel tiling, "own" pipeline): each step's WGMMAs are waited for only
    after the next step's are issued, and its slot released then (:func:`_k_split_own_pipeline`'s
    ``drain``), so a step's decode overlaps the previous step's WGMMAs.
    """

    bk: int = 256
    split_k: int = 2
    stages: int = 4
    decode: str = "mul"
    x_swizzle: int = 32
    warp_specialized: bool = False
    raw_scales: bool = False
    launcher: str = "pallas_call"
    k_split_wgs: int = 1
    k_split_pipeline: str = "own"
    cluster: int = 1
    tile_major: bool = False
    chunks: int = 1
    fold_scale: bool = False
    delay_release: bool = False

    def __post_init__(self):
        for name in ("bk", "split_k", "stages", "x_swizzle", "k_split_wgs", "cluster", "chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"MgpuConfig.{name} must be an int, got {v!r}")
        for name in ("warp_specialized", "raw_scales", "tile_major", "fold_scale", "delay_release"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"MgpuConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.decode not in DECODES:
            raise ValueError(f"MgpuConfig.decode must be one of {DECODES}, got {self.decode!r}")
        if self.bk < BLOCK_SIZE or self.bk % BLOCK_SIZE:
            raise ValueError(f"MgpuConfig.bk must be a positive multiple of {BLOCK_SIZE}, got {self.bk}")
        if self.split_k < 1 or self.stages < 1:
            raise ValueError(f"MgpuConfig.split_k and stages must be >= 1, got {self.split_k}, {self.stages}")
        if self.launcher not in ("pallas_call", "kernel"):
            raise ValueError(f"MgpuConfig.launcher must be 'pallas_call' or 'kernel', got {self.launcher!r}")
        if self.raw_scales and not self.warp_specialized:
            raise ValueError("MgpuConfig.raw_scales needs warp_specialized=True")
        if self.warp_specialized and self.decode not in _PTX_DECODES:
            raise ValueError('MgpuConfig.warp_specialized needs decode="ptx" or "pairs"')
        if self.warp_specialized and self.stages < 2:
            raise ValueError(f"MgpuConfig.warp_specialized needs stages >= 2 (a TMA warpgroup feeding the compute "
                             f"warpgroups), got stages={self.stages}")
        if self.x_swizzle != 32:
            raise ValueError(f"MgpuConfig.x_swizzle must be 32, got {self.x_swizzle}")
        if self.k_split_wgs not in K_SPLIT_WGS:
            raise ValueError(f"MgpuConfig.k_split_wgs must be one of {K_SPLIT_WGS}, got {self.k_split_wgs!r}")
        if self.k_split_wgs == 1 and self.k_split_pipeline != "own":
            raise ValueError(f"MgpuConfig.k_split_pipeline applies to k_split_wgs > 1 only, got "
                             f"k_split_pipeline={self.k_split_pipeline!r} with k_split_wgs=1")
        if self.k_split_wgs > 1:
            if not self.warp_specialized or self.decode not in _PTX_DECODES:
                raise ValueError('MgpuConfig.k_split_wgs > 1 needs warp_specialized=True and decode="pairs" or "ptx"')
            if self.split_k != 1:
                raise ValueError(f"MgpuConfig.k_split_wgs > 1 needs split_k=1 (each CTA sums the whole K range "
                                 f"itself), got split_k={self.split_k}")
            if self.raw_scales:
                raise ValueError("MgpuConfig.k_split_wgs > 1 does not take raw_scales")
            if self.k_split_pipeline not in K_SPLIT_PIPELINES:
                raise ValueError(f"MgpuConfig.k_split_pipeline must be one of {K_SPLIT_PIPELINES}, "
                                 f"got {self.k_split_pipeline!r}")
            if self.k_split_pipeline == "jax":
                need, pool = _ws_register_demand(self.k_split_wgs, _MEMORY_REGISTERS)
                if need > pool:
                    raise ValueError(
                        f'MgpuConfig.k_split_pipeline="jax" with k_split_wgs={self.k_split_wgs} would deadlock: '
                        f"plgpu.emit_pipeline_warp_specialized's setmaxnreg asks {need} registers of the "
                        f"{pool} a CTA of {128 * (self.k_split_wgs + 1)} threads is launched with "
                        '(use k_split_pipeline="own")')
        if self.cluster not in CLUSTERS:
            raise ValueError(f"MgpuConfig.cluster must be one of {CLUSTERS}, got {self.cluster!r}")
        if (self.cluster > 1 or self.tile_major) and (self.k_split_wgs == 1 or self.k_split_pipeline != "own"):
            raise ValueError("MgpuConfig.cluster > 1 and tile_major need the one-kernel tiling (k_split_wgs > 1) "
                             f'with k_split_pipeline="own", got k_split_wgs={self.k_split_wgs}, '
                             f"k_split_pipeline={self.k_split_pipeline!r}")
        if self.chunks != 1:
            if self.k_split_wgs == 1 or self.decode not in _PAIR_DECODES:
                raise ValueError(f'MgpuConfig.chunks > 1 needs the one-kernel tiling (k_split_wgs > 1) and decode="pairs" or "lanes", '
                                 f"got chunks={self.chunks}, k_split_wgs={self.k_split_wgs}, decode={self.decode!r}")
            slice_k = self.bk // self.k_split_wgs  # one warpgroup's K per step
            if self.chunks < 1 or slice_k % (self.chunks * _K_SLICE_MIN):
                raise ValueError(f"MgpuConfig.chunks={self.chunks} must divide each warpgroup's {slice_k} K columns "
                                 f"per step into parts of a multiple of {_K_SLICE_MIN} (whole 128-byte swizzle "
                                 "tiles of x)")
        if self.fold_scale and (self.decode != "lanes" or self.k_split_wgs == 1):
            raise ValueError(f'MgpuConfig.fold_scale needs decode="lanes" with the one-kernel tiling (k_split_wgs > 1), '
                             f"got decode={self.decode!r}, k_split_wgs={self.k_split_wgs}")
        if self.delay_release and self.fold_scale:
            raise ValueError("MgpuConfig.delay_release with fold_scale: wrong results on the H200 (jax 0.11.2, "
                             "2 warpgroups; each alone passed there); not supported together")
        if self.delay_release and (self.k_split_wgs == 1 or self.k_split_pipeline != "own"):
            raise ValueError('MgpuConfig.delay_release needs the one-kernel tiling (k_split_wgs > 1) with '
                             f'k_split_pipeline="own", got k_split_wgs={self.k_split_wgs}, '
                             f"k_split_pipeline={self.k_split_pipeline!r}")
        if self.k_split_wgs > 1 and self.bk % (self.k_split_wgs * _K_SLICE_MIN):
            raise ValueError(f"MgpuConfig.k_split_wgs={self.k_split_wgs} needs bk to be a multiple of "
                             f"{self.k_split_wgs * _K_SLICE_MIN} (each warpgroup's K slice a multiple of "
                             f"{_K_SLICE_MIN}: whole swizzle tiles), got bk={self.bk}")


def _tiled(swizzle_bytes: int, itemsize: int):
    """TMA transforms of a shared-memory tile whose rows are swizzled by ``swizzle_bytes``: 8-row
    tiles one swizzle wide (``swizzle_bytes / itemsize`` elements), then the swizzle."""
    plgpu = _plgpu()
    return (plgpu.TilingTransform((8, swizzle_bytes // itemsize)), plgpu.SwizzleTransform(swizzle_bytes))


def _ws_stages(cfg: MgpuConfig, steps: int, per_stage: int, fixed: int, what: str, steps_of: str = "") -> int:
    """Pipeline depth of a warp-specialized launcher: ``cfg.stages`` capped by the K steps and by
    what fits in shared memory (``fixed`` bytes + ``per_stage`` per stage); ValueError below two
    stages (the warp-specialized pipeline needs two), ``what`` naming the configuration."""
    stages = min(cfg.stages, steps, (_SMEM_BUDGET - fixed) // per_stage)
    if stages < 2:
        raise ValueError(f"mgpu_w4a16: {what} needs two pipeline stages ({steps} K steps{steps_of} of {per_stage} "
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


def decode_e2m1_bits(code, decode: str = "mul"):
    """E2M1 codes (unsigned ints < 16, any integer array type incl. a Mosaic GPU fragment) ->
    bfloat16 value, by integer operations and one bfloat16 multiply (``"mul"``) or selects
    (``"select"``). Used inside the kernel; jnp-traceable, so tests run it in NumPy/XLA too."""
    c = code.astype(jnp.uint16)
    mag = c & jnp.uint16(7)
    sign = (c & jnp.uint16(8)) << jnp.uint16(12)
    if decode == "mul":
        bits = sign | (mag << jnp.uint16(6))
        two126 = lax.bitcast_convert_type(jnp.uint16(_BF16_2P126), jnp.bfloat16)
        return lax.bitcast_convert_type(bits, jnp.bfloat16) * two126
    if decode == "select":
        bits = (mag << jnp.uint16(6)) + jnp.uint16(0x3F00)
        bits = jnp.where(mag < jnp.uint16(2), mag * jnp.uint16(0x3F00), bits)
        return lax.bitcast_convert_type(sign | bits, jnp.bfloat16)
    raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")


def kernel_scales(w_scales):
    """E8M0 scale bytes uint8 [N, K/32] -> the kernel's form, bfloat16 [K/32, N] (2^(b-127))."""
    bits = e8m0_to_bf16_bits(w_scales)
    return lax.bitcast_convert_type(bits, jnp.bfloat16).T


def _ptx_fragment_order():
    """Column j of a decoded [64, 16] half-fragment (one block) <- byte ``order[j]`` of the
    block's 16 bytes, for the "ptx" decode: in Mosaic GPU's WGMMA_LAYOUT_8BIT each thread holds
    bytes 4g..4g+3 of a row's block (g = lane % 4) and the bf16 WGMMA A layout asks it for
    columns 2g, 2g+1 (register 0) and 8+2g, 8+2g+1 (register 1); the decode turns bytes
    4g, 4g+1 into register 0 and 4g+2, 4g+3 into register 1."""
    j = np.arange(BLOCK_SIZE // 2)
    return 4 * ((j % 8) // 2) + 2 * (j // 8) + j % 2


def split_x(x, decode: str):
    """bfloat16 x [M, K] -> (x_lo, x_hi) [M, K/2]: the elements that meet the decoded low- and
    high-nibble fragments. Natural order (even, odd elements) for "mul"/"select"; for "ptx"
    each block's 16 columns follow :func:`_ptx_fragment_order` (a permutation of the
    contraction applied to both operands)."""
    if decode != "ptx":
        return e2m1_asm.split_even_odd(x)
    m, k = x.shape
    # element 32b + 2p + n with byte p = 4g + 2ct + e (_ptx_fragment_order: column j = 8ct + 2g + e)
    xb = x.reshape(m, k // BLOCK_SIZE, 4, 2, 2, 2)  # (g, ct, e, nibble n)
    xb = jnp.transpose(xb, (0, 1, 3, 2, 4, 5))  # (ct, g, e, n)
    return xb[..., 0].reshape(m, k // 2), xb[..., 1].reshape(m, k // 2)


def permute_x_pairs(x):
    """bfloat16 x [M, K] -> the contraction order that meets natural-order weight bytes under the
    ``"pairs"`` decode: within each 32-element block, x'[8t + 2g + e] = x[8g + 2t + e] (the
    element-pair form of :func:`pair_order_bytes`; a permutation applied to both operands)."""
    m, k = x.shape
    return pair_order_bytes(x.reshape(m, k // 2, 2), axis=1).reshape(m, k)  # element pairs as "bytes"


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


def _scale_byte(sref, raw: bool, row, b: int):
    """The E8M0 byte (i32 MLIR value) of weight row ``row`` (an index value) and block ``b`` from
    the scales in shared memory: uint8 [64, nb] as stored (``raw``) or K-major [nb, 64]."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref

    blk = arith.constant(ir.IndexType.get(), b)
    return arith.extui(ir.IntegerType.get_signless(32), memref.load(sref, [row, blk] if raw else [blk, row]))


def _pair_registers(q, s2, asm: str) -> list:
    """The four bfloat16x2 registers that the "pairs"/"lanes" PTX ``asm`` of
    :mod:`jax_mxfp4.kernels.e2m1_asm` makes from a 32-bit weight word ``q`` and its bfloat16x2
    scale operand ``s2`` (i32 MLIR values; inside an ``inline_mgpu`` body)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [q, s2], asm, e2m1_asm.DECODE_PAIRS_CONSTRAINTS)
    return [mgpu.utils.bitcast(llvm.extractvalue(i32, res, [t]), bf2) for t in range(4)]


def _decode_folded(fa, sref, raw: bool, b0: int, b1: int, out, pairs_asm: bool = False, quad=None):
    """The "lanes" decode (``pairs_asm``: the "pairs" decode) of a thread's registers for blocks
    b0 <= b < b1 with the two bfloat16 multiplies folded into one where they can be
    (:attr:`MgpuConfig.fold_scale`): when every E8M0
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
        items.append(((4 * (b - b0), rh), quad(q) if quad else q, _scale_byte(sref, raw, row, b)))
    top = items[0][2]
    for _, _, sb in items[1:]:
        top = arith.maxui(top, sb)
    small = arith.cmpi(arith.CmpIPredicate.ule, top, arith.constant(i32, e2m1_asm.FOLD_MAX_BYTE))
    # one side per warp (vote.sync.all): a warp whose threads disagreed would run both sides
    # (NVIDIA H200, jax 0.11.2, 2026-12-02, scale bytes 120..129: 24.3 us against 17.7 unfolded)
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


def _decode_ptx(byt, s_ref, hb: int, raw: bool = False, pairs: bool = False, blocks: tuple[int, int] | None = None,
                lanes: bool = False, fold: bool = False, quad: bool = False):
    """Packed bytes uint8 [64, hb] (WGMMA_LAYOUT_8BIT) and the scale block bfloat16 [hb/16, 64]
    (shared memory) -> bfloat16 (lo, hi) [64, hb] in the WGMMA layout, by the inline PTX of
    :mod:`jax_mxfp4.kernels.e2m1_asm` (the same instructions the Triton kernel runs): one 32-bit
    register of 4 bytes -> 4 bfloat16x2 registers (low / high nibbles of bytes 0,1 and 2,3).
    ``pairs``: one bfloat16 [64, 2 hb] fragment instead, each byte -> one bfloat16x2 register
    (its two elements in order; ``e2m1_asm._DECODE_PAIRS_PTX``): byte t of a thread's register for
    block b fills fragment column group 4b + t (columns 32b + 8t + 2g, +1).
    ``blocks`` ("pairs" only): decode only the 32-element blocks b0 <= b < b1 of the tile, as a
    [64, 32 (b1 - b0)] fragment (:attr:`MgpuConfig.chunks`: a tile decoded in parts, each part's
    WGMMAs issued before the next part is decoded).
    ``quad`` ("pairs" only): the bytes are in natural order; each 32-bit word is first moved to
    the "pairs" order across its quad of threads (``e2m1_asm.QUAD_TRANSPOSE_PTX``: two
    ``shfl.sync.bfly`` and two ``prmt``), so a plain MXFP4Array's bytes meet x as it is."""
    plgpu = _plgpu()
    nb = hb // (BLOCK_SIZE // 2)
    if quad and (not pairs or lanes):
        raise ValueError("_decode_ptx: quad needs the pairs decode (natural bytes to the pairs order)")
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
        # sref: bfloat16 [nb, 64] (kernel_scales form) or uint8 [64, nb] (E8M0 bytes as stored)
        del ctx
        import jax.experimental.mosaic.gpu as mgpu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, memref

        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        kmajor_bytes = not raw and ir.MemRefType(sref.type).element_type == ir.IntegerType.get_signless(8)
        if fold and not (raw or kmajor_bytes):
            raise ValueError("_decode_ptx: fold needs the scales as E8M0 bytes")

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
            _decode_folded(fa, sref, raw, b0, b1, lo, pairs_asm=not lanes, quad=quad_fn)
            mk = lambda r: mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
            return (mk(lo),)
        for (row, _col), ridx in zip(fa.layout.thread_idxs(fa.shape), np.ndindex(regs.shape)):
            b, rh = ridx[1], ridx[4]
            if not b0 <= b < b1:
                continue
            if raw or kmajor_bytes:  # E8M0 bytes [64, nb] as stored or K-major [nb, 64]
                s2 = _e8m0_pair(_scale_byte(sref, raw, row, b))
            else:
                sc = memref.load(sref, [arith.constant(index, b), row])
                s32 = arith.extui(i32, arith.bitcast(i16, sc))
                s2 = arith.ori(s32, arith.shli(s32, arith.constant(i32, 16)))
            q = mgpu.utils.bitcast(regs[ridx], i32)
            if quad:
                q = quad_fn(q)
            if pairs:  # "lanes": the same outputs from bytes in lanes_order_bytes' nibble order
                asm = e2m1_asm._DECODE_LANES_PTX if lanes else e2m1_asm._DECODE_PAIRS_PTX
                for t, reg in enumerate(_pair_registers(q, s2, asm)):
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


def _wgmma_step(x_refs, byt, s_ref, acc_ref, hb: int, decode: str, raw: bool = False, chunks: int = 1,
                fold: bool = False):
    """Decode one [64, hb] byte tile in registers and issue its WGMMAs ("ptx": ``lo @ x_lo^T +
    hi @ x_hi^T`` over the two halves of x; "pairs": ``w @ x^T`` over x's [mp, 2 hb] tile).
    ``chunks`` ("pairs"): the tile's blocks in that many parts, each part's WGMMAs issued (async)
    before the next part is decoded, so the tensor cores work while the next part decodes.
    ``fold`` (a one-fragment decode, E8M0 byte scales): :func:`_decode_folded`. Returns the number of
    WGMMA groups committed (for ``wgmma_wait``)."""
    plgpu = _plgpu()
    if decode in _PAIR_DECODES or decode == "natural":  # "natural": the "pairs" decode after a quad transpose
        (x_ref,) = x_refs
        nb = hb // (BLOCK_SIZE // 2)
        per = nb // chunks
        for c in range(chunks):
            blocks = (c * per, (c + 1) * per) if chunks > 1 else None
            xc = x_ref.at[:, pl.ds(c * per * BLOCK_SIZE, per * BLOCK_SIZE)] if chunks > 1 else x_ref
            plgpu.wgmma(acc_ref, _decode_ptx(byt, s_ref, hb, raw, pairs=True, blocks=blocks, lanes=decode == "lanes",
                                             fold=fold, quad=decode == "natural"),
                        plgpu.transpose_ref(xc, (1, 0)))
        return chunks
    xe_ref, xo_ref = x_refs
    lo, hi = _decode_ptx(byt, s_ref, hb, raw)
    plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xe_ref, (1, 0)))
    plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xo_ref, (1, 0)))
    return 2


def _step(x_refs, w_ref, s_ref, acc_ref, cfg: MgpuConfig):
    """One K step of one warpgroup: decode the [64, bk/2] byte tile with its scales and
    accumulate into the WGMMA accumulator (waited for). ``x_refs``: (x,) for "pairs", else the
    two halves (x_lo, x_hi) of :func:`split_x`."""
    plgpu = _plgpu()
    half = BLOCK_SIZE // 2  # bytes per row of one block; also the WGMMA K of one half-fragment
    if cfg.decode in _PTX_DECODES:
        _wgmma_step(x_refs, _load(w_ref, plgpu.Layout.WGMMA_8BIT), s_ref, acc_ref, cfg.bk // 2, cfg.decode)
        plgpu.wgmma_wait(0)
        return
    xe_ref, xo_ref = x_refs
    for b in range(cfg.bk // BLOCK_SIZE):
        byt = _load(w_ref.at[:, pl.ds(b * half, half)], plgpu.Layout.WGMMA, optimized=False)
        sc = _load(s_ref.at[b], plgpu.Layout.WGMMA.reduce(1), optimized=False)
        scb = plgpu.layout_cast(lax.broadcast_in_dim(sc, (_WG_ROWS, half), (0,)),
                                plgpu.Layout.WGMMA)
        u = byt.astype(jnp.uint16)
        lo = decode_e2m1_bits(u & jnp.uint16(15), cfg.decode) * scb
        hi = decode_e2m1_bits(u >> jnp.uint16(4), cfg.decode) * scb
        xs = pl.ds(b * half, half)
        plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xe_ref.at[:, xs], (1, 0)))
        plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xo_ref.at[:, xs], (1, 0)))
    plgpu.wgmma_wait(0)


def _kernel(*refs, cfg: MgpuConfig, steps: int, nx: int):
    *x_refs, w_ref, s_ref, o_ref, acc_ref = refs
    assert len(x_refs) == nx
    _step(tuple(x_refs), w_ref, s_ref, acc_ref, cfg)

    @pl.when(pl.program_id(2) == steps - 1)
    def _():
        o_ref[...] = acc_ref[...]


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
    operands of :func:`_step` (one for "pairs", two halves otherwise)."""
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


def _warp_specialized_call(xs, w_data, scales, *, cfg: MgpuConfig, n: int, mp: int):
    """Two compute warpgroups (64 weight rows each) and one TMA warpgroup per CTA; one CTA per
    (128-row tile, K split). Returns float32 partial sums [split_k * N, mp]."""
    plgpu = _plgpu()
    rows = 2 * _WG_ROWS
    if n % rows:
        raise ValueError(f"mgpu_w4a16: N={n} must be a multiple of {rows} (warp_specialized)")
    k_half = w_data.shape[1]
    hb, nb = cfg.bk // 2, cfg.bk // BLOCK_SIZE
    kh_split = k_half // cfg.split_k
    steps = kh_split // hb
    nt = n // rows
    nx = len(xs)
    xcols = cfg.bk // nx  # x columns per step and operand
    kx_split = xs[0].shape[1] // cfg.split_k
    x_tr, w_tr = _tiled(_swizzle(xcols * 2), 2), _tiled(_swizzle(hb), 1)
    raw = cfg.raw_scales
    nbs = kh_split // (BLOCK_SIZE // 2)  # scale bytes per row of one K split
    per_stage = 2 * mp * hb * 2 + rows * hb + (0 if raw else nb * rows * jnp.dtype(scales.dtype).itemsize)
    fixed = 2 * _WG_ROWS * mp * 4 + (rows * nbs if raw else 0)
    if raw and not 16 <= nbs <= 256:
        raise ValueError(f"mgpu_w4a16: raw_scales needs 16..256 scale bytes per row and K split, got {nbs}")
    stages = _ws_stages(cfg, steps, per_stage, fixed, f"warp_specialized with bk={cfg.bk}, split_k={cfg.split_k}, "
                        f"K={2 * k_half} and {mp} padded rows", " per split")

    def body(*refs, out_smem, slab, slab_bar):
        x_g, (w_g, s_g, out_g) = refs[:nx], refs[nx:]
        cta = lax.axis_index("cta")
        tile, sp = lax.rem(cta, nt), lax.div(cta, nt)
        wg = lax.axis_index("wg")
        wrows = pl.ds(wg * _WG_ROWS, _WG_ROWS)
        if raw:  # this CTA's scale bytes, once: [128 rows, K/32 / split_k]
            @pl.when(wg == 2)
            def _():
                plgpu.copy_gmem_to_smem(s_g.at[pl.ds(tile * rows, rows), pl.ds(sp * nbs, nbs)], slab,
                                        slab_bar)

            @pl.when(wg < 2)
            def _():
                plgpu.barrier_wait(slab_bar)

        def mma_body(idx, *refs):
            x_s, w_s, rest = refs[:nx], refs[nx], refs[nx + 1:]
            if raw:
                (acc_ref,) = rest
                (t,) = idx
                sref = slab.at[wrows, pl.ds(t * nb, nb)]
            else:
                s_s, acc_ref = rest
                sref = s_s.at[:, wrows]
            _wgmma_step(x_s, _load(w_s.at[wrows], plgpu.Layout.WGMMA_8BIT), sref, acc_ref, hb, cfg.decode, raw)
            plgpu.wgmma_wait(0)
            return acc_ref

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_WG_ROWS, mp), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                out_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg], out_g.at[pl.ds(sp * n + tile * rows + wg * _WG_ROWS, _WG_ROWS)])
                plgpu.wait_smem_to_gmem(0)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            mma_body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute_context,
            in_specs=[plgpu.BlockSpec((mp, xcols), lambda t: (0, t), transforms=x_tr)] * nx + [
                plgpu.BlockSpec((rows, hb), lambda t: (0, t), transforms=w_tr),
            ] + ([] if raw else [plgpu.BlockSpec((nb, rows), lambda t: (t, 0))]))
        ks = pl.ds(sp * kh_split, kh_split)
        xk = pl.ds(sp * kx_split, kx_split)
        operands = [xg.at[:, xk] for xg in x_g] + [w_g.at[pl.ds(tile * rows, rows), ks]]
        if not raw:
            operands.append(s_g.at[pl.ds(sp * nbs, nbs), pl.ds(tile * rows, rows)])
        pipeline(*operands)

    _check_eager_device(xs[0])
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((cfg.split_k * n, mp), jnp.float32),
        grid=(nt * cfg.split_k,), grid_names=("cta",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=dict(out_smem=plgpu.SMEM((2, _WG_ROWS, mp), jnp.float32),
                            slab=plgpu.SMEM((rows, nbs) if raw else (8, 16), jnp.uint8),
                            slab_bar=plgpu.Barrier(num_arrivals=1)),
    )
    return f(*xs, w_data, scales)


def _wg_k_slice(wg, bk: int, kw: int, nx: int):
    """Compute warpgroup ``wg``'s share of one pipeline step under ``k_split_wgs = kw``: the
    (start, size) of its weight bytes per row, of its scale blocks and of its columns of each x
    operand (``nx`` = 1: x's natural K columns, the "pairs" decode; 2: the columns of each half
    of :func:`split_x`, the "ptx" decode), as offsets inside the step's tiles. Whole 32-element
    blocks, so the bytes, their scales and the x columns they meet are the same blocks in every
    byte order and x split (both permute only inside a block). ``wg`` may be traced."""
    hbw, nbw, xw = bk // 2 // kw, bk // BLOCK_SIZE // kw, bk // nx // kw
    return (wg * hbw, hbw), (wg * nbw, nbw), (wg * xw, xw)


def _k_split_call(xs, w_data, scales, *, cfg: MgpuConfig, n: int, mp: int, out_dtype):
    """One kernel, final output: ``cfg.k_split_wgs`` (kw) compute warpgroups and one TMA warpgroup
    per CTA, one CTA per 64-row weight tile (grid N/64, no split-K across CTAs). Every pipeline
    step brings [64, bk/2] weight bytes, their [bk/32, 64] scales and x's [mp, bk] columns (two
    [mp, bk/2] halves for "ptx"); compute warpgroup w decodes and multiplies its own slice
    (K columns w*bk/kw .. (w+1)*bk/kw of the step: bytes, scale blocks and x columns of the same
    32-blocks) into its own float32 accumulator [64, mp]. After the last step, warpgroups 1..kw-1
    store their accumulators to shared memory and arrive on one barrier (every thread arrives
    after its own stores: mbarrier arrive has release, the wait acquire semantics); warpgroup 0
    waits, adds them to its own in warpgroup order (a fixed order: deterministic), casts to
    ``out_dtype`` and stores the tile transposed (Mosaic GPU's WGMMA_TRANSPOSED layout into the
    transposed view of a swizzled [mp, 64] buffer), then one TMA store to out[:, tile]. The same
    barrier pattern as the schedule barrier of jax's attention_mgpu.py (num_arrivals = the
    warpgroups that arrive). Returns ``out_dtype`` [mp, N].

    The pipeline (``cfg.k_split_pipeline``): "own" (:func:`_k_split_own_pipeline`) or "jax"
    (``plgpu.emit_pipeline_warp_specialized``; 2 compute warpgroups only, MgpuConfig says why).
    ``xs`` may have fewer rows than ``mp`` (fewer than 8, or a multiple of 8: Mosaic GPU's TMA
    tiling) with the "own" pipeline: its TMA copies read a box of
    ``mp`` rows, and the hardware fills rows past the array's end with zeros (and the output's TMA
    store writes none past it), so the call needs no pad of x and no slice of the result (H200,
    2026-12-01: 1.5 + 1.0 us of separate kernels per call at M = 1); the output then has
    ``xs[0]``'s rows. Both: ``stages`` shared-memory slots; step t uses slot t % stages; ready[slot] completes when
    the slot's TMA copies have landed (every compute warpgroup waits on it), consumed[slot] when
    all kw compute warpgroups have finished reading it (each arrives once per step, after its
    WGMMAs were waited for), and the TMA warpgroup waits on it before refilling the slot."""
    plgpu = _plgpu()
    kw = cfg.k_split_wgs
    k_half = w_data.shape[1]
    hb, nb = cfg.bk // 2, cfg.bk // BLOCK_SIZE
    steps = k_half // hb
    nt = n // _WG_ROWS
    nx = len(xs)
    xcols = cfg.bk // nx  # x columns per step and operand
    (_, hbw), _, (_, xw) = _wg_k_slice(0, cfg.bk, kw, nx)  # one warpgroup's bytes per row, x columns
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

    def mma(wg, x_s, w_s, s_s, acc_ref, delay=False):
        """Compute warpgroup ``wg``'s slice of one step (tiles of one slot), waited for; ``delay``
        (MgpuConfig.delay_release): waited only down to this step's own WGMMA groups, so the
        previous step's are done (its slot may be released) and this step's run on."""
        (b0, bn), (s0, sn), (x0, xn) = _wg_k_slice(wg, cfg.bk, kw, nx)
        x_w = tuple(r.at[:, pl.ds(x0, xn)] for r in x_s)
        byt = _load(w_s.at[:, pl.ds(b0, bn)], plgpu.Layout.WGMMA_8BIT)
        groups = _wgmma_step(x_w, byt, s_s.at[pl.ds(s0, sn)], acc_ref, bn, cfg.decode, chunks=cfg.chunks,
                             fold=cfg.fold_scale)
        plgpu.wgmma_wait(groups if delay else 0)

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
                   sum_bar=plgpu.Barrier(num_arrivals=kw - 1))

    if cfg.k_split_pipeline == "own":
        scratch.update(
            x_smem=[plgpu.SMEM((stages, mp, xcols), jnp.bfloat16, transforms=x_tr) for _ in range(nx)],
            w_smem=plgpu.SMEM((stages, _WG_ROWS, hb), jnp.uint8, transforms=w_tr),
            s_smem=plgpu.SMEM((stages, nb, _WG_ROWS), scales.dtype),
            ready=plgpu.Barrier(num_arrivals=nx + 2, num_barriers=stages),  # one arrival per TMA copy
            consumed=plgpu.Barrier(num_arrivals=kw, num_barriers=stages))  # one per compute warpgroup

        if cfg.cluster > 1:  # every CTA of a cluster waits until all of them consumed a slot (x is multicast)
            scratch["consumed"] = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=kw,
                                                       num_barriers=stages)

        def body(*refs, part_smem, o_smem, sum_bar, x_smem, w_smem, s_smem, ready, consumed):
            x_g, (w_g, s_g, out_g) = refs[:nx], refs[nx:]
            tile = lax.axis_index("cta")
            if cfg.cluster > 1:
                tile = tile * cfg.cluster + lax.axis_index("cluster")
            wg = lax.axis_index("wg")
            rows = pl.ds(tile * _WG_ROWS, _WG_ROWS)
            multicast = "cluster" if cfg.cluster > 1 else None

            def fetch(t, slot):  # step t's tiles into ``slot``, each copy arriving on ready[slot]
                for xg, xs_ in zip(x_g, x_smem):
                    plgpu.copy_gmem_to_smem(xg.at[pl.ds(0, mp), pl.ds(t * xcols, xcols)], xs_.at[slot], ready.at[slot],
                                            collective_axes=multicast)
                if cfg.tile_major:  # step t of this tile: one contiguous [64, hb] block, [nb, 64] scales
                    tt = tile * steps + t
                    plgpu.copy_gmem_to_smem(w_g.at[pl.ds(tt * _WG_ROWS, _WG_ROWS)], w_smem.at[slot], ready.at[slot])
                    plgpu.copy_gmem_to_smem(s_g.at[pl.ds(tt * nb, nb)], s_smem.at[slot], ready.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(w_g.at[rows, pl.ds(t * hb, hb)], w_smem.at[slot], ready.at[slot])
                    plgpu.copy_gmem_to_smem(s_g.at[pl.ds(t * nb, nb), rows], s_smem.at[slot], ready.at[slot])

            def step(slot, acc_ref):
                mma(wg, [r.at[slot] for r in x_smem], w_smem.at[slot], s_smem.at[slot], acc_ref,
                    delay=cfg.delay_release)

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_WG_ROWS, mp), jnp.float32))
                def _(acc_ref):
                    run(acc_ref)
                    finish(wg, acc_ref[...], part_smem, o_smem, sum_bar, out_g, tile)

            _k_split_own_pipeline(wg, kw, steps, stages, fetch=fetch, step=step, ready=ready, consumed=consumed,
                                  compute_context=compute_context,
                                  drain=(lambda _: plgpu.wgmma_wait(0)) if cfg.delay_release else None)

    else:
        def body(*refs, part_smem, o_smem, sum_bar):
            x_g, (w_g, s_g, out_g) = refs[:nx], refs[nx:]
            tile = lax.axis_index("cta")
            wg = lax.axis_index("wg")

            def mma_body(_, *refs):
                x_s, w_s, s_s, acc_ref = refs[:nx], refs[nx], refs[nx + 1], refs[nx + 2]
                mma(wg, x_s, w_s, s_s, acc_ref)
                return acc_ref

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_WG_ROWS, mp), jnp.float32))
                def _(acc_ref):
                    eval_pipeline(acc_ref)
                    finish(wg, acc_ref[...], part_smem, o_smem, sum_bar, out_g, tile)

            pipeline = plgpu.emit_pipeline_warp_specialized(
                mma_body, grid=(steps,), memory_registers=_MEMORY_REGISTERS, wg_axis="wg", num_compute_wgs=kw,
                max_concurrent_steps=stages, compute_context=compute_context,
                in_specs=[plgpu.BlockSpec((mp, xcols), lambda t: (0, t), transforms=x_tr)] * nx + [
                    plgpu.BlockSpec((_WG_ROWS, hb), lambda t: (0, t), transforms=w_tr),
                    plgpu.BlockSpec((nb, _WG_ROWS), lambda t: (t, 0))])
            rows = pl.ds(tile * _WG_ROWS, _WG_ROWS)
            pipeline(*x_g, w_g.at[rows], s_g.at[:, rows])

    if nt % cfg.cluster:
        raise ValueError(f"mgpu_w4a16: MgpuConfig.cluster={cfg.cluster} needs N/64 = {nt} weight tiles to be a "
                         "multiple of the cluster size")
    if cfg.cluster > 1 and not multicast_splits(mp, xcols, cfg.cluster):
        raise ValueError(f"mgpu_w4a16: MgpuConfig.cluster={cfg.cluster} cannot split x's [{mp}, {xcols}] tile "
                         f"among the cluster's CTAs ({mp // 8} row tiles x {xcols // 64} column tiles of [8, 64])")
    if cfg.tile_major:  # the [N, K/2] bytes / [K/32, N] scales hold tile_major_layout's order: 2-D views of it
        w_data = w_data.reshape(nt * steps * _WG_ROWS, hb)
        scales = scales.reshape(nt * steps * nb, _WG_ROWS)
    _check_eager_device(xs[0])
    clusters = dict(cluster=(cfg.cluster,), cluster_names=("cluster",)) if cfg.cluster > 1 else {}
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((xs[0].shape[0], n), out_dtype),
        grid=(nt // cfg.cluster,), grid_names=("cta",), **clusters,
        num_threads=kw + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=scratch,
    )
    return f(*xs, w_data, scales)


def multicast_splits(mp: int, xcols: int, cluster: int) -> bool:
    """Whether Mosaic GPU's TMA multicast can split x's [mp, xcols] bfloat16 tile (8-row tiles 64
    columns wide, 128-byte swizzle) among ``cluster`` CTAs: each CTA issues one part; the parts
    come from the leading dimensions of the tiled shape [mp/8, xcols/64, 8, 64] in order, each
    taken whole or divided (the rule of ``LaunchContext.async_copy``, jax 0.10-0.11).
    Raises TypeError for non-int arguments (bool included), ValueError for ``mp`` not a positive
    multiple of 8, ``xcols`` not a positive multiple of 64 or ``cluster`` not in :data:`CLUSTERS`."""
    for name, v in (("mp", mp), ("xcols", xcols), ("cluster", cluster)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"multicast_splits: {name} must be an int, got {v!r}")
    if mp < 8 or mp % 8 or xcols < 64 or xcols % 64 or cluster not in CLUSTERS:
        raise ValueError(f"multicast_splits: mp must be a positive multiple of 8, xcols of 64 and cluster one of "
                         f"{CLUSTERS}, got mp={mp}, xcols={xcols}, cluster={cluster}")
    rem = cluster
    for size in (mp // 8, xcols // 64, 8):
        if size % rem == 0:
            return True
        if rem % size:
            return False
        rem //= size
    return rem == 1


def _k_split_own_pipeline(wg, kw: int, steps: int, stages: int, *, fetch, step, ready, consumed, compute_context,
                          drain=None, registers: tuple[int, int] | None = None):
    """The warp-specialized pipeline of :func:`_k_split_call` (``k_split_pipeline="own"``): the
    schedule of ``plgpu.emit_pipeline_warp_specialized`` (jax 0.11, automatic barriers, no
    delay_release) without its ``setmaxnreg`` (MgpuConfig.k_split_pipeline says why that
    deadlocks with 4 compute warpgroups): every warpgroup keeps the registers it is launched with
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
    finished when it returns), arrive on consumed[t % stages]. With ``drain`` (the delayed
    release of MgpuConfig.delay_release): ``step(slot, carry)`` may leave its reads of the slot
    in flight but returns only when the previous step's have finished (WGMMAs waited down to its
    own groups), so step t arrives on consumed[(t - 1) % stages] instead (t >= 1), and after the
    last step ``drain(carry)`` (finishes every read) and the last slot's arrival.
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
                if drain is None:
                    plgpu.barrier_arrive(consumed.at[slot])
                else:
                    @pl.when(t > 0)
                    def _():
                        plgpu.barrier_arrive(consumed.at[lax.rem(t + stages - 1, stages)])

            if drain is not None:
                drain(carry)
                plgpu.barrier_arrive(consumed.at[(steps - 1) % stages])

        compute_context(run)


SCALE_FORMS = ("rows", "kmajor", "bf16")


def tile_major_layout(w_data, scales_kmajor, bk: int):
    """The packed weight bytes [N, K/2] and their K-major E8M0 scales [K/32, N] rearranged for
    ``MgpuConfig(tile_major=True)`` with the same ``bk``: every (64-row tile, K step) block of the
    bytes ([64, bk/2]) and of the scales ([bk/32, 64]) contiguous, tiles outer, steps inner, so
    each pipeline step's TMA copy reads one contiguous run of memory (16 KiB at bk 512) instead
    of 64 row segments 64 bytes apart. Same shapes and dtypes; an exact permutation of bytes."""
    for name, v in (("w_data", w_data), ("scales_kmajor", scales_kmajor)):
        if not hasattr(v, "shape") or len(v.shape) != 2:
            raise ValueError(f"tile_major_layout: {name} must be a 2-D array, got "
                             f"{getattr(v, 'shape', type(v).__name__)}")
    if isinstance(bk, (bool, np.bool_)) or not isinstance(bk, (int, np.integer)) or bk < BLOCK_SIZE or bk % BLOCK_SIZE:
        raise ValueError(f"tile_major_layout: bk must be a positive multiple of {BLOCK_SIZE} (an int), got {bk!r}")
    n, hk = w_data.shape
    nt, hb, nb = n // _WG_ROWS, bk // 2, bk // BLOCK_SIZE
    steps = hk // hb
    if n % _WG_ROWS or hk % hb or scales_kmajor.shape != (steps * nb, n):
        raise ValueError(f"tile_major_layout: w_data [N, K/2] with N % 64 == 0 and K % bk == 0, scales [K/32, N]; "
                         f"got {w_data.shape}, {scales_kmajor.shape}, bk={bk}")
    w = w_data.reshape(nt, _WG_ROWS, steps, hb).transpose(0, 2, 1, 3).reshape(n, hk)
    s = scales_kmajor.reshape(steps, nb, nt, _WG_ROWS).transpose(2, 0, 1, 3).reshape(steps * nb, n)
    return w, s


def mgpu_w4a16(x, w_data, w_scales, out_dtype=jnp.bfloat16, cfg: MgpuConfig | None = None,
               *, scales_form: str = "rows", w_order: str = "natural"):
    """``x · Wᵀ`` for bfloat16 x [M, K] and MXFP4 W -> [M, N] of ``out_dtype`` (float32 accumulation).

    Args:
      x: bfloat16 [M, K], M <= 256 (activation rows; padded to a multiple of 16 inside).
      w_data: uint8 [N, K/2] packed E2M1 (element 2j in the low nibble of byte j); N % 64 == 0.
      w_scales: E8M0 scale bytes as ``scales_form`` says: "rows" uint8 [N, K/32] (the plain layout;
        transposed to "kmajor" per call, one small XLA transpose), "kmajor" uint8 [K/32, N] (the
        kernel's own layout: read by TMA and converted to bfloat16 in registers, no per-call
        work; what :func:`jax_mxfp4.prepare_decode` stores), or "bf16" the bfloat16 [K/32, N] from
        :func:`kernel_scales` (measurement only). "rows" and "kmajor" also take the same bytes as
        ``float8_e8m0fnu`` (e.g. ``DecodePrepared.scales``; a bitcast). ``cfg.raw_scales`` takes "rows".
      out_dtype: float32, bfloat16 or float16. cfg: :class:`MgpuConfig` (default MgpuConfig()).
      w_order: byte order of ``w_data``: "natural" (byte j = elements 2j, 2j+1), "pairs"
        (:func:`pair_order_bytes`): the "pairs" decode then reads x as it is (with "natural"
        bytes it reads x permuted per call, :func:`permute_x_pairs`, one small XLA pass), or
        "lanes" (:func:`jax_mxfp4.decode_prepared.lanes_order_bytes` of "pairs" bytes, what
        :func:`jax_mxfp4.prepare_decode` stores by default): read by the "lanes" decode only,
        and only it reads them. The other decodes take "natural" only.
    Runs only on an NVIDIA Hopper GPU (sm_90a) through Mosaic GPU.
    Raises:
      TypeError: ``cfg`` not an MgpuConfig; ``x``, ``w_data`` or ``w_scales`` not arrays.
      RuntimeError: called eagerly with ``x`` on a device other than a GPU (traced calls are
        checked when lowered: Pallas refuses other platforms).
      ValueError: ranks, shapes, dtypes (``out_dtype`` included), K = 0, a K that is not a
        multiple of ``cfg.bk * cfg.split_k``, an unknown ``w_order``, "pairs" bytes with a
        decode other than "pairs", "lanes" bytes and the "lanes" decode not paired with each
        other; ``cfg.tile_major`` with scales other than "kmajor"; ``cfg.cluster`` with N/64 not
        a multiple of it or an x tile it cannot split (:func:`multicast_splits`); ``cfg.k_split_wgs`` > 1 with fewer than two K steps or
        without shared memory for two pipeline stages.
    With ``cfg.k_split_wgs`` > 1 the kernel writes the result itself (``[M, N]`` of
    ``out_dtype``; sliced to M rows afterwards when M is not the padded row count, :func:`padded_rows`): one kernel per
    call for "kmajor" scales, x rows already padded (:func:`padded_rows`), "pairs" bytes and decode (other forms add
    their per-call XLA work on x or the scales: the "ptx" x split, the "pairs" x permutation for
    natural bytes, the "rows" scale transpose).
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
    if w_order == "pairs" and cfg.decode != "pairs":
        raise ValueError(f'mgpu_w4a16: w_order="pairs" bytes need MgpuConfig(decode="pairs"), got {cfg.decode!r}')
    if scales_form not in SCALE_FORMS:
        raise ValueError(f"mgpu_w4a16: scales_form must be one of {SCALE_FORMS}, got {scales_form!r}")
    if scales_form != "bf16" and w_scales.dtype == jnp.float8_e8m0fnu:
        w_scales = as_scale_bytes(w_scales)  # the same bytes (what prepare_decode stores)
    sshape = (n, k // BLOCK_SIZE) if scales_form == "rows" else (k // BLOCK_SIZE, n)
    sdtype = jnp.bfloat16 if scales_form == "bf16" else jnp.uint8
    if w_scales.shape != sshape or w_scales.dtype != sdtype:
        raise ValueError(f"mgpu_w4a16: w_scales ({scales_form!r}) must be {jnp.dtype(sdtype).name} {sshape}, "
                         f"got {w_scales.dtype} {w_scales.shape}")
    if n % _WG_ROWS:
        raise ValueError(f"mgpu_w4a16: N={n} must be a multiple of {_WG_ROWS}")
    if not 1 <= m <= 256:
        raise ValueError(f"mgpu_w4a16: M={m} must be in [1, 256] (decode sizes)")
    if k % (cfg.bk * cfg.split_k):
        raise ValueError(f"mgpu_w4a16: K={k} is not a multiple of bk*split_k={cfg.bk * cfg.split_k}")
    if cfg.tile_major and scales_form != "kmajor":
        raise ValueError(f"mgpu_w4a16: MgpuConfig(tile_major=True) takes the bytes and K-major scale bytes of "
                         f"tile_major_layout (scales_form 'kmajor'), got {scales_form!r}")
    if cfg.fold_scale and scales_form == "bf16":
        raise ValueError("mgpu_w4a16: MgpuConfig(fold_scale=True) reads the E8M0 bytes (scales_form 'rows' or "
                         "'kmajor'), got 'bf16'")
    if cfg.raw_scales and scales_form != "rows":
        raise ValueError(f"mgpu_w4a16: raw_scales takes the E8M0 bytes [N, K/32] (scales_form 'rows'), "
                         f"got {scales_form!r}")
    plgpu = _plgpu()
    scales = w_scales.T if scales_form == "rows" and not cfg.raw_scales else w_scales
    if cfg.decode not in _PTX_DECODES and scales.dtype == jnp.uint8:  # the "mul"/"select" decodes load bfloat16 scales
        scales = lax.bitcast_convert_type(e8m0_to_bf16_bits(scales), jnp.bfloat16)
    sbytes = jnp.dtype(scales.dtype).itemsize
    mp = padded_rows(m, cfg)
    # the one-kernel route takes x and writes out unpadded where Mosaic GPU's TMA takes their rows
    # (fewer than its 8-row tile, or whole tiles): TMA reads rows past M as zeros and stores none
    as_is = cfg.k_split_wgs > 1 and cfg.k_split_pipeline == "own" and (m < 8 or m % 8 == 0)
    xp = x if as_is or mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    if cfg.decode in _PAIR_DECODES:  # one x operand, natural order for "pairs"/"lanes" bytes
        xs = (xp if w_order in _PAIR_DECODES else permute_x_pairs(xp),)
    else:
        xs = split_x(xp, cfg.decode)
    steps = k // (cfg.bk * cfg.split_k)
    nt = n // _WG_ROWS
    hb = cfg.bk // 2
    xcols = cfg.bk // len(xs)  # x columns per step and operand
    sw = cfg.x_swizzle if cfg.decode not in _PTX_DECODES else _swizzle(xcols * 2)
    x_tr = _tiled(sw, 2)
    wsw = _swizzle(hb)
    w_tr = _tiled(wsw, 1) if cfg.decode in _PTX_DECODES else ()
    x_spec = plgpu.BlockSpec((mp, xcols), lambda i, s, t: (0, s * steps + t), transforms=x_tr)
    if cfg.k_split_wgs > 1:  # one kernel, its output final: no sum, transpose or cast after it
        out = _k_split_call(xs, w_data, scales, cfg=cfg, n=n, mp=mp, out_dtype=out_dtype)
        return out if out.shape[0] == m else out[:m]
    if cfg.warp_specialized:
        out = _warp_specialized_call(xs, w_data, scales, cfg=cfg, n=n, mp=mp)
        out = out.reshape(cfg.split_k, n, mp).sum(axis=0)
        return out[:, :m].T.astype(out_dtype)
    # shared memory: x halves, weight bytes and scales per stage, the output block (x2) below the
    # H100/H200 limit of 227 KiB
    per_stage = 2 * mp * hb * 2 + _WG_ROWS * hb + (cfg.bk // BLOCK_SIZE) * _WG_ROWS * sbytes
    fit = max(1, (_SMEM_BUDGET - 2 * _WG_ROWS * mp * 4) // per_stage)
    stages = max(1, min(cfg.stages, steps, fit))
    if cfg.launcher == "kernel":
        specs = [plgpu.BlockSpec((mp, xcols), lambda t: (0, t), transforms=x_tr)] * len(xs) + [
                 plgpu.BlockSpec((_WG_ROWS, hb), lambda t: (0, t), transforms=w_tr),
                 plgpu.BlockSpec((cfg.bk // BLOCK_SIZE, _WG_ROWS), lambda t: (t, 0))]
        out = _kernel_call(xs, w_data, scales, cfg=cfg, n=n, mp=mp, stages=stages, specs=specs)
    else:
        _check_eager_device(xs[0])
        out = pl.pallas_call(
            functools.partial(_kernel, cfg=cfg, steps=steps, nx=len(xs)),
            out_shape=jax.ShapeDtypeStruct((cfg.split_k * n, mp), jnp.float32),
            grid=(nt, cfg.split_k, steps),
            in_specs=[x_spec] * len(xs) + [
                plgpu.BlockSpec((_WG_ROWS, hb), lambda i, s, t: (i, s * steps + t), transforms=w_tr),
                plgpu.BlockSpec((cfg.bk // BLOCK_SIZE, _WG_ROWS), lambda i, s, t: (s * steps + t, i)),
            ],
            out_specs=plgpu.BlockSpec((_WG_ROWS, mp), lambda i, s, t: (s * nt + i, 0)),
            scratch_shapes=[plgpu.ACC((_WG_ROWS, mp), jnp.float32)],
            compiler_params=plgpu.CompilerParams(
                dimension_semantics=["parallel", "parallel", "sequential"],
                max_concurrent_steps=stages,
                lowering_semantics=plgpu.LoweringSemantics.Lane,
            ),
            name="mxfp4_w4a16_mgpu",
        )(*xs, w_data, scales)
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
    (jax 0.11.2, fair timing, 16x8192x8192): one-warpgroup ``plgpu.kernel``, bk 256, split-K 4
    (2026-11-30: within 5% of the best of 11 tilings; warp-specialized and ``raw_scales`` slower).
    Decode by byte order (2026-12-01, same run): "pairs" bytes (prepare_decode) take the "pairs"
    decode, x read as it is: 34.0 us = 0.73x of bf16 against 36.6 us = 0.78x for "ptx" (kernel
    sums 23.7 vs 23.2 us: the gain is the x split's kernel and its launch); natural bytes keep the
    "ptx" decode: its x split (one XLA fusion, ~1.9 us through dispatch) is cheaper than the
    "pairs" x permutation (~3.4 us). "pairs" bytes take the one-kernel tiling with 4 compute
    warpgroups where it applies (:func:`k_split_config`; NVIDIA H200, jax 0.11.2, 2026-12-01,
    same timing runs: 16x8192x8192 33.0 us = 0.70x of bf16 against 36.1 us = 0.77x for
    the split-K kernel, 1x8192x8192 0.89x against 0.95x; checked there at 1, 16 and 40 rows and on
    every E8M0 byte); natural bytes keep the split-K kernel (the "ptx" one-kernel variant is untimed).

    Args: ``m`` activation rows, ``n`` weight rows, ``k`` the contraction ([m, k] x [n, k]).
    Raises:
      TypeError: ``m``, ``n`` or ``k`` not an int (bool included).
      ValueError: ``m`` or ``n`` < 1; ``k`` not a positive multiple of 64; ``w_order`` not one
        of :data:`W_ORDERS`. (M > 64 and N % 64 are :func:`unsupported_reason`'s to report.)"""
    _check_config_args("default_mgpu_config", m, n, k, w_order)
    if w_order in _PAIR_DECODES:
        one_kernel = k_split_config(m, n, k, w_order, k_split_wgs=4)
        if one_kernel is not None:
            return one_kernel
    bk, split = 256, 4
    while k % (bk * split):
        if split > 1:
            split //= 2
        else:
            bk //= 2
    decode = w_order if w_order in _PAIR_DECODES else "ptx"
    return MgpuConfig(bk=bk, split_k=split, stages=4, decode=decode, launcher="kernel")


def k_split_config(m: int, n: int, k: int, w_order: str = "natural", k_split_wgs: int = 2) -> MgpuConfig | None:
    """The one-kernel tiling (:attr:`MgpuConfig.k_split_wgs`) for a shape, or None where it does not
    apply: bk 512 (each of 2 warpgroups a 256-element slice: whole 128-byte swizzle tiles), else
    256 or 128, the largest that divides K in at least two steps and gives each warpgroup at least
    64 elements, and two pipeline stages fit in shared memory for ``m`` rows (padded to 16; 64 rows
    and K 2048 at bk 512 did not on the H200); stages 5 (lowered where shared memory is
    short). Decode by byte order as
    :func:`default_mgpu_config`, which takes it with ``k_split_wgs=4`` for "pairs" bytes (measured
    faster there; the "ptx" decode's one-kernel variant is untimed).

    Raises:
      TypeError / ValueError: ``m``, ``n``, ``k`` or ``w_order`` as :func:`default_mgpu_config`
        (a typo in ``w_order`` would otherwise pick the "ptx" decode); ``k_split_wgs`` not the
        int 2 or 4."""
    _check_config_args("k_split_config", m, n, k, w_order)
    if (isinstance(k_split_wgs, bool) or not isinstance(k_split_wgs, (int, np.integer))
            or k_split_wgs not in K_SPLIT_WGS[1:]):
        raise ValueError(f"k_split_config: k_split_wgs must be one of {K_SPLIT_WGS[1:]}, got {k_split_wgs!r}")
    mp = -(-max(m, 1) // 16) * 16
    for bk in (512, 256, 128):
        per_stage, fixed = _k_split_smem(mp, bk, k_split_wgs, 4, 2)  # float32 output, bf16 scales: the largest
        if (bk % (k_split_wgs * _K_SLICE_MIN) == 0 and k % bk == 0 and k // bk >= 2
                and _SMEM_BUDGET - fixed >= 2 * per_stage):
            decode = w_order if w_order in _PAIR_DECODES else "ptx"
            # decode in two parts where each part is whole x swizzle tiles (H200, jax 0.11.2,
            # 2026-12-01, "lanes" 16x8192x8192: 3% faster; a wash at M = 1)
            chunks = 2 if decode in _PAIR_DECODES and (bk // k_split_wgs) % (2 * _K_SLICE_MIN) == 0 else 1
            # one multiply for x 2^126 x scale (H200, jax 0.11.2, 2026-12-02, 4 warpgroups: 8-9% faster
            # at 16x8192x8192 and M = 1; checked there on every E8M0 byte)
            fold = decode == "lanes" and k_split_wgs == 4
            return MgpuConfig(bk=bk, split_k=1, stages=5, decode=decode, warp_specialized=True,
                              k_split_wgs=k_split_wgs, chunks=chunks, fold_scale=fold)
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
