"""The Mosaic GPU w4a16 kernel's tilings (jax_mxfp4/kernels/wgemm_mgpu.py) that
tests/gpu/test_gpu_wgemm_mgpu.py checks on a Hopper GPU, and how each is called. Plain data and
functions (no device needed): tests/test_wgemm_mgpu.py lowers the k_split_wgs ones for CUDA on
the CPU at the shapes checked here.

Names: "k" = ``plgpu.kernel`` + ``emit_pipeline`` (one warpgroup), "ws" = warp-specialized, "ks2"
/ "ks4" = one kernel per call with 2 / 4 compute warpgroups sharing each 64-row tile's K steps
(the output written by the kernel), "raw" = E8M0 bytes [N, K/32] read by the kernel; decodes
"pairs", "ptx", "lanes"; "tm" = tile-major weight layout, "c2"/"c4" = x multicast by TMA to a
cluster of 2/4 CTAs, "ch2"/"ch4" = each warpgroup's tile decoded in 2/4 parts, "fold" = the
2^126 and scale multiplies folded into one, "delay" = each step's WGMMAs waited one step late,
"jax" = jax's ``plgpu.emit_pipeline_warp_specialized`` instead of the module's own pipeline.
Suffix: the weight's byte order, " P" pairs (what prepare_decode stored before the lanes order),
" L" lanes, none natural (x permuted per call); " B" = scales as bfloat16 [K/32, N]."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_mxfp4.decode_prepared import lanes_order_bytes, pair_order_bytes
from jax_mxfp4.kernels.wgemm_mgpu import MgpuConfig, kernel_scales, tile_major_layout


def _one_kernel(decode="pairs", k_split_wgs=4, **more):
    """A one-kernel tiling (bk 512, 5 stages, warp-specialized) with ``more`` of MgpuConfig's fields."""
    return MgpuConfig(bk=512, split_k=1, stages=5, decode=decode, warp_specialized=True, k_split_wgs=k_split_wgs,
                      **more)


VARIANTS = {  # name -> MgpuConfig
    "k pairs bk256 s4 st4 P": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", launcher="kernel"),
    "k pairs bk256 s4 st4 N": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", launcher="kernel"),
    "k ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx", launcher="kernel"),
    "ws pairs bk256 s2 st4 P": MgpuConfig(bk=256, split_k=2, stages=4, decode="pairs", warp_specialized=True),
    "k pairs bk256 s2 st4 P": MgpuConfig(bk=256, split_k=2, stages=4, decode="pairs", launcher="kernel"),
    "k pairs bk512 s4 st3 P": MgpuConfig(bk=512, split_k=4, stages=3, decode="pairs", launcher="kernel"),
    "k pairs bk128 s4 st8 P": MgpuConfig(bk=128, split_k=4, stages=8, decode="pairs", launcher="kernel"),
    "k pairs bk256 s4 st2 P": MgpuConfig(bk=256, split_k=4, stages=2, decode="pairs", launcher="kernel"),
    "k pairs bk256 s8 st4 P": MgpuConfig(bk=256, split_k=8, stages=4, decode="pairs", launcher="kernel"),
    "ws pairs bk256 s4 st4 P": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", warp_specialized=True),
    "ws raw ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx", warp_specialized=True,
                                          raw_scales=True),
    # one kernel per call; stages are capped by shared memory (5 at bk 512, 16 rows)
    "ks2 pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                        k_split_wgs=2),
    "ks4 pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    "ks4 tm pairs bk512 st5 P": _one_kernel(tile_major=True),
    "ks4 c2 pairs bk512 st5 P": _one_kernel(cluster=2),
    "ks4 c2 tm pairs bk512 st5 P": _one_kernel(cluster=2, tile_major=True),
    "ks4 c4 tm pairs bk512 st5 P": _one_kernel(cluster=4, tile_major=True),
    "ks4 ch2 pairs bk512 st5 P": _one_kernel(chunks=2),
    "ks2 ch2 pairs bk512 st5 P": _one_kernel(k_split_wgs=2, chunks=2),
    "ks2 ch4 pairs bk512 st5 P": _one_kernel(k_split_wgs=2, chunks=4),
    "ks4 pairs bk512 st5 P B": _one_kernel(),
    "ks4 ch2 pairs bk512 st5 P B": _one_kernel(chunks=2),
    "ks4 lanes bk512 st5 L": _one_kernel("lanes"),
    "ks4 ch2 lanes bk512 st5 L": _one_kernel("lanes", chunks=2),
    "ks2 ch2 lanes bk512 st5 L": _one_kernel("lanes", k_split_wgs=2, chunks=2),
    # fold and delay each alone (both together at ks2 gave wrong results and are refused)
    "ks4 ch2 lanes fold L": _one_kernel("lanes", chunks=2, fold_scale=True),
    "ks4 ch2 lanes delay L": _one_kernel("lanes", chunks=2, delay_release=True),
    "ks2 ch2 lanes fold L": _one_kernel("lanes", k_split_wgs=2, chunks=2, fold_scale=True),
    "ks2 ch2 lanes delay L": _one_kernel("lanes", k_split_wgs=2, chunks=2, delay_release=True),
    "ks4 pairs bk256 st8 P": MgpuConfig(bk=256, split_k=1, stages=8, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    "ks4 pairs bk512 st3 P": MgpuConfig(bk=512, split_k=1, stages=3, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    "ks2 pairs bk256 st8 P": MgpuConfig(bk=256, split_k=1, stages=8, decode="pairs", warp_specialized=True,
                                        k_split_wgs=2),
    "ks2 ptx bk512 st5": MgpuConfig(bk=512, split_k=1, stages=5, decode="ptx", warp_specialized=True,
                                    k_split_wgs=2),
    "ks2 jax pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                            k_split_wgs=2, k_split_pipeline="jax"),
}

# one variant per structure (launcher x warp specialization x scales x decode x byte order x
# flags): each gets the small-shape and every-byte checks; the others share a structure with one
SMOKE = ["k pairs bk256 s4 st4 P", "k pairs bk256 s4 st4 N", "k ptx bk256 s4 st4", "ws pairs bk256 s2 st4 P",
         "ks2 pairs bk512 st5 P", "ks4 pairs bk512 st5 P", "ks2 ptx bk512 st5", "ks2 jax pairs bk512 st5 P",
         "ks4 tm pairs bk512 st5 P", "ks4 c2 pairs bk512 st5 P", "ks4 c2 tm pairs bk512 st5 P",
         "ks4 c4 tm pairs bk512 st5 P", "ks4 ch2 pairs bk512 st5 P", "ks2 ch2 pairs bk512 st5 P",
         "ks2 ch4 pairs bk512 st5 P", "ks4 lanes bk512 st5 L", "ks4 ch2 lanes bk512 st5 L",
         "ks2 ch2 lanes bk512 st5 L", "ks4 ch2 lanes fold L", "ks4 ch2 lanes delay L",
         "ks2 ch2 lanes fold L", "ks2 ch2 lanes delay L"]


def struct(c):
    """A variant's structure (same structure = same code path): decode, launcher, flags."""
    return (c.decode, c.warp_specialized, c.raw_scales, c.launcher, c.k_split_wgs, c.k_split_pipeline, c.cluster,
            c.tile_major, c.fold_scale, c.delay_release)


STRUCTURES = SMOKE + [nm for nm, c in VARIANTS.items() if all(struct(VARIANTS[sm]) != struct(c) for sm in SMOKE)]
"""SMOKE and each variant whose structure no SMOKE variant shares ("ws raw ptx ..."): one
variant per structure."""


def smoke_of(name):
    """The variant of :data:`STRUCTURES` that shares ``name``'s structure."""
    return next(sm for sm in STRUCTURES if struct(VARIANTS[sm]) == struct(VARIANTS[name]))


def small_case(cfg):
    """(m, n, k) of the small case per structure: 16x256x1024 (2 K steps at bk 512), K 512 per
    split for ``raw_scales`` (which needs 16 scale bytes per row and K split)."""
    return (16, 256, max(1024, 512 * cfg.split_k) if cfg.raw_scales else 1024)


def bisect_ks(cfg):
    """The k_split_wgs pipeline cases (m, n, k): 16x256xK with K steps = stages, stages + 1 and
    2 stages + 1 (the pipeline's slots reused once, twice; the smoke case has 2 steps)."""
    return [(16, 256, cfg.bk * s) for s in sorted({cfg.stages, cfg.stages + 1, 2 * cfg.stages + 1})]


def edge_config(cfg):
    """The variant's config at the every-byte shape (16x256x1024, several K steps): bk 64 with two
    K splits, or for k_split_wgs its own bk (whole swizzle tiles per warpgroup), split_k 1."""
    if cfg.k_split_wgs > 1:
        return dataclasses.replace(cfg, stages=2)
    return dataclasses.replace(cfg, bk=64, split_k=2, stages=2)


def w_order(name):
    """The byte order a variant's weight is stored in (``mgpu_w4a16(w_order=...)``)."""
    if name.endswith(" L"):
        return "lanes"
    return "pairs" if name.endswith(" P") or name.endswith(" P B") else "natural"


def bf16_scales(name):
    """Whether the variant takes its scales as bfloat16 [K/32, N] (``kernel_scales``)."""
    return name.endswith(" B")


def stored(data, name):
    """The packed weight bytes as the variant ``name`` reads them."""
    if w_order(name) == "lanes":
        return lanes_order_bytes(pair_order_bytes(data))
    return pair_order_bytes(data) if w_order(name) == "pairs" else data


def call_args(name, cfg, data, scale_rows):
    """(weight bytes, scales, scales_form) of ``mgpu_w4a16`` for the variant: the bytes in its
    byte order; the E8M0 scale bytes [N, K/32] as given ("rows"), bfloat16 [K/32, N] for the " B"
    variants, or for ``tile_major`` both rearranged by ``tile_major_layout`` (K-major scales)."""
    d = stored(data, name)
    if bf16_scales(name):
        return d, kernel_scales(scale_rows), "bf16"
    if cfg.tile_major:
        d, s = tile_major_layout(d, scale_rows.T, cfg.bk)
        return d, s, "kmajor"
    return d, scale_rows, "rows"


def k_split_diagnosis(got, x, q, cfg, odt):
    """Where a failing k_split_wgs result goes wrong: rel_fro against the product of warpgroup
    0's K slices only (~0: the other warpgroups' partial sums were not added, i.e. the barrier or
    shared-memory exchange), and per 64-column tile against the reference's values sorted (~0
    while the plain comparison fails: right values, wrong places, i.e. the transposed store)."""
    import jax.numpy as jnp

    import jax_mxfp4 as mx
    from jax_mxfp4.kernels.wgemm_mgpu import _wg_k_slice

    dims = (((1,), (1,)), ((), ()))
    rec = mx.Recipe(backend="xla", quantize_activations=False)
    k = x.shape[1]
    nb = cfg.bk // 32
    keep = np.zeros(k // 32, bool)
    _, (s0, sn), _ = _wg_k_slice(0, cfg.bk, cfg.k_split_wgs, 1)
    for t in range(k // cfg.bk):
        keep[t * nb + s0: t * nb + s0 + sn] = True
    x0 = x * jnp.asarray(np.repeat(keep, 32), x.dtype)
    rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))  # noqa: E731
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(mx.dot_general(x, q, dims, recipe=rec, preferred_element_type=odt).astype(jnp.float32),
                     np.float64)
    ref0 = np.asarray(mx.dot_general(x0, q, dims, recipe=rec, preferred_element_type=odt).astype(jnp.float32),
                      np.float64)

    def tiles(a):
        return np.sort(a.reshape(a.shape[0], -1, 64).transpose(1, 0, 2).reshape(a.shape[1] // 64, -1), axis=1)

    return {"rel_fro": rel(g, ref), "rel_fro_vs_wg0_slices_only": rel(g, ref0),
            "rel_fro_sorted_per_tile": rel(tiles(g), tiles(ref)),
            "nan_count": int(np.isnan(g).sum()), "zero_fraction": float(np.mean(g == 0))}
