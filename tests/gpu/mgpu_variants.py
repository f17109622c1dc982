"""The Mosaic GPU w4a16 kernel's tilings (jax_mxfp4/kernels/wgemm_mgpu.py) that
tests/gpu/test_gpu_wgemm_mgpu.py checks on a Hopper GPU, and how each is called. Plain data and
functions (no device needed): tests/test_wgemm_mgpu.py lowers the k_split_wgs ones for CUDA on
the CPU at the shapes checked here.

Names: "k" = the split-K tiling (``plgpu.kernel`` + ``emit_pipeline``, one warpgroup), "ks4" =
one kernel per call with 4 compute warpgroups sharing each 64-row tile's K steps (the output
written by the kernel, the 2^126 and scale multiplies folded into one); decodes "ptx", "lanes";
"ch2" = each warpgroup's tile decoded in 2 parts.
Suffix: the weight's byte order, " L" lanes (what prepare_decode stores), none natural."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_mxfp4.decode_prepared import lanes_order_bytes, pair_order_bytes
from jax_mxfp4.kernels.wgemm_mgpu import MgpuConfig


def _one_kernel(**more):
    """A one-kernel tiling (bk 512, 5 stages) with ``more`` of MgpuConfig's fields."""
    return MgpuConfig(bk=512, split_k=1, stages=5, decode="lanes", k_split_wgs=4, **more)


VARIANTS = {  # name -> MgpuConfig
    "k ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx"),
    "k lanes bk256 s4 st4 L": MgpuConfig(bk=256, split_k=4, stages=4, decode="lanes"),
    "k lanes bk128 s4 st8 L": MgpuConfig(bk=128, split_k=4, stages=8, decode="lanes"),
    "k lanes bk256 s8 st4 L": MgpuConfig(bk=256, split_k=8, stages=4, decode="lanes"),
    # one kernel per call; stages are capped by shared memory (5 at bk 512, 16 rows)
    "ks4 lanes bk512 st5 L": _one_kernel(),
    "ks4 ch2 lanes bk512 st5 L": _one_kernel(chunks=2),
    "ks4 lanes bk256 st8 L": MgpuConfig(bk=256, split_k=1, stages=8, decode="lanes", k_split_wgs=4),
    "ks4 lanes bk512 st3 L": MgpuConfig(bk=512, split_k=1, stages=3, decode="lanes", k_split_wgs=4),
}

# one variant per structure (tiling x decode x byte order x flags): each gets the small-shape
# and every-byte checks; the others share a structure with one
SMOKE = ["k ptx bk256 s4 st4", "k lanes bk256 s4 st4 L", "ks4 lanes bk512 st5 L", "ks4 ch2 lanes bk512 st5 L"]


def struct(c):
    """A variant's structure (same structure = same code path): decode, tiling, flags."""
    return (c.decode, c.k_split_wgs, c.chunks)


STRUCTURES = SMOKE + [nm for nm, c in VARIANTS.items() if all(struct(VARIANTS[sm]) != struct(c) for sm in SMOKE)]
"""SMOKE and each variant whose structure no SMOKE variant shares: one variant per structure."""


def smoke_of(name):
    """The variant of :data:`STRUCTURES` that shares ``name``'s structure."""
    return next(sm for sm in STRUCTURES if struct(VARIANTS[sm]) == struct(VARIANTS[name]))


def small_case(cfg):
    """(m, n, k) of the small case per structure: 16x256x1024 (2 K steps at bk 512)."""
    del cfg
    return (16, 256, 1024)


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
    return "lanes" if name.endswith(" L") else "natural"


def stored(data, name):
    """The packed weight bytes as the variant ``name`` reads them."""
    return lanes_order_bytes(pair_order_bytes(data)) if w_order(name) == "lanes" else data


def call_args(name, cfg, data, scale_rows):
    """(weight bytes, scales, scales_form) of ``mgpu_w4a16`` for the variant: the bytes in its
    byte order, the E8M0 scale bytes [N, K/32] as given ("rows")."""
    del cfg
    return stored(data, name), scale_rows, "rows"


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
    _, (s0, sn), _ = _wg_k_slice(0, cfg.bk, cfg.k_split_wgs)
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
