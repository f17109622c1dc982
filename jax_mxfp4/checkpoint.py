"""MXFP4 checkpoints in the published "blocks/scales" layout, read and written with ``safetensors``.

Layout (the one published MXFP4 checkpoints such as gpt-oss use; one pair of tensors per
quantized weight, the contraction axis K last; the ``_blocks``/``_scales`` name suffixes follow
the Hugging Face gpt-oss files as we know them, not checked against a downloaded checkpoint here:
for other names use :func:`from_blocks_scales`/:func:`to_blocks_scales` directly):

* ``{name}_blocks``: uint8 ``[..., K/32, 16]``: 32 E2M1 codes per block, two per byte, element
  2i in the low nibble (bits 0-3) and element 2i+1 in the high nibble (sign in bit 3 of each);
* ``{name}_scales``: uint8 ``[..., K/32]``: the E8M0 shared scale of each block (value
  2^(byte-127), 0xFF = NaN; OCP MX v1.0 §5.2).

This is :class:`jax_mxfp4.MXFP4Array`'s own packing (same nibble order, same scale bytes), so
import and export are exact byte permutations: nothing is dequantized or re-quantized. Tensors
that are not such a pair (norms, embeddings, biases) are stored and loaded as they are.

What the bytes do not say -- the weight's record (:mod:`jax_mxfp4.weight_record`: quantized axis
and logical shape, scale layout, logical dtype, scale rule, Hadamard rotation) -- is written by
:func:`save_mxfp4` as one safetensors metadata entry per pair, ``"jax_mxfp4.record.{name}"``
(JSON, format 1), and given back by :func:`load_mxfp4`. Pairs without one (published
checkpoints, files written before records existed) load with the caller's ``axes``/``dtype``,
scale rule "even" and no rotation; the Flax layers refuse such a weight when their recipe says
otherwise.

Needs the ``safetensors`` package (``pip install ".[checkpoint]"`` from a checkout).
"""

from __future__ import annotations

import os

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from . import checks, weight_record
from .array import MXFP4Array
from .mx_format import BLOCK_SIZE

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BYTES_PER_BLOCK = BLOCK_SIZE // 2


def to_blocks_scales(q: MXFP4Array) -> tuple[np.ndarray, np.ndarray]:
    """``MXFP4Array`` -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) with K last.

    The other dims keep their order; K is ``q``'s quantized axis (moved last). Swizzled scales
    are un-swizzled first. Exact: only bytes are moved. Raises TypeError if ``q`` is not an
    MXFP4Array.
    """
    if not isinstance(q, MXFP4Array):
        raise TypeError(f"q must be an MXFP4Array, got {type(q).__name__}")
    data = np.moveaxis(np.asarray(q.data), q.axis, -1)
    blocks = data.reshape(data.shape[:-1] + (data.shape[-1] // BYTES_PER_BLOCK, BYTES_PER_BLOCK))
    scales = np.moveaxis(np.asarray(q.plain_scales()).view(np.uint8), q.axis, -1)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def from_blocks_scales(blocks, scales, *, dtype=jnp.bfloat16, axis: int = -1, name: str = "tensor") -> MXFP4Array:
    """(blocks [..., K/32, 16], scales [..., K/32]) -> ``MXFP4Array`` of logical shape [..., K].

    Args:
      blocks: uint8 array, last dim 16 (32 packed E2M1 codes per block).
      scales: uint8 (E8M0 bytes) or ``float8_e8m0fnu`` array of shape ``blocks.shape[:-1]``.
      dtype: the logical dtype recorded in the MXFP4Array (float32, bfloat16 (default) or
        float16): what :func:`jax_mxfp4.dequantize` and w4a16 GEMMs treat it as.
      axis: where the quantized axis K goes in the result (default -1: last, as stored). E.g.
        ``axis=0`` for a stored ``[N, K]`` weight turns it into a Flax-style ``[K, N]`` kernel
        (the other dims keep their order; bytes are only moved).
      name: the tensor's name, used in error messages.

    Raises:
      TypeError: blocks or scales of the wrong dtype; a non-float ``dtype``.
      ValueError: blocks without a trailing dim of 16 or fewer than 2 dims; scales not of shape
        ``blocks.shape[:-1]``; ``axis`` out of range. Each message names ``name``.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8:
        raise TypeError(f"{name}{BLOCKS_SUFFIX}: blocks must be uint8 (two E2M1 codes per byte), got {blocks.dtype}")
    if scales.dtype == np.dtype(jnp.float8_e8m0fnu):
        scales = scales.view(np.uint8)
    if scales.dtype != np.uint8:
        raise TypeError(f"{name}{SCALES_SUFFIX}: scales must be uint8 E8M0 bytes, got {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(
            f"{name}{BLOCKS_SUFFIX}: blocks must have shape [..., K/32, {BYTES_PER_BLOCK}] (32 E2M1 codes per "
            f"block, two per byte), got {blocks.shape}"
        )
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"{name}{SCALES_SUFFIX}: scales must have shape {blocks.shape[:-1]} (one E8M0 byte per block of "
            f"{name}{BLOCKS_SUFFIX} {blocks.shape}), got {scales.shape}"
        )
    checks.check_mx_dtype(dtype, f"dtype of {name}")
    nblk = blocks.shape[-2]
    data = blocks.reshape(blocks.shape[:-2] + (nblk * BYTES_PER_BLOCK,))
    ndim = data.ndim
    axis = checks.normalize_axis(axis, ndim, f"axis for {name}")
    data = np.moveaxis(data, -1, axis)
    sc = np.moveaxis(scales, -1, axis)
    shape = tuple(d * 2 if i == axis else d for i, d in enumerate(data.shape))
    return MXFP4Array(jnp.asarray(data), jnp.asarray(sc.view(jnp.float8_e8m0fnu)), axis, shape, dtype)


def save_mxfp4(path, tensors: Mapping, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to a safetensors file; each MXFP4Array as a ``{name}_blocks`` /
    ``{name}_scales`` pair (K last, see the module docstring) plus its record in the metadata
    (``"jax_mxfp4.record.{name}"``), other arrays as they are. ``metadata`` (str -> str) is
    stored alongside.

    Raises TypeError for a non-str name or a prepared weight (save its ``to_mxfp4()``),
    ValueError for a name that collides with a pair's ``_blocks``/``_scales`` tensor, or a
    ``metadata`` key starting with ``"jax_mxfp4.record."`` (reserved for the records).
    """
    from safetensors.numpy import save_file

    out: dict[str, np.ndarray] = {}
    meta = dict(metadata) if metadata else {}
    reserved = [k for k in meta if str(k).startswith(weight_record.RECORD_KEY_PREFIX)]
    if reserved:
        raise ValueError(f"metadata keys {reserved} start with {weight_record.RECORD_KEY_PREFIX!r}, which is reserved "
                         "for the records of the MXFP4 tensors; rename them")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if hasattr(t, "to_mxfp4"):  # an FP8Prepared or DecodePrepared: the checkpoint layout is MXFP4's
            raise TypeError(f"tensor {name!r} is a prepared weight ({type(t).__name__}); save t.to_mxfp4() (its exact MXFP4Array) "
                            "and prepare it again after loading")
        if isinstance(t, MXFP4Array):
            pair = dict(zip((name + BLOCKS_SUFFIX, name + SCALES_SUFFIX), to_blocks_scales(t)))
            meta.update(weight_record.to_metadata(name, t))
        else:
            pair = {name: np.ascontiguousarray(np.asarray(t))}
        for k, v in pair.items():
            if k in out:
                raise ValueError(f"tensor name {k!r} is written twice (an MXFP4 pair and another tensor)")
            out[k] = v
    save_file(out, str(path), metadata=meta or None)


def load_mxfp4(path, *, dtype=None, axes: Mapping[str, int] | None = None) -> dict:
    """Read a safetensors file; every ``{name}_blocks``/``{name}_scales`` pair becomes
    ``{name}: MXFP4Array``, every other tensor is returned as a NumPy array under its own name.

    A pair with a record (written by :func:`save_mxfp4`) comes back exactly as saved: its
    quantized axis (unless ``axes`` moves it), logical shape and dtype, scale layout, scale
    rule and Hadamard rotation. A pair without one (a published checkpoint) gets logical
    ``dtype`` (default bfloat16), the quantized axis ``axes.get(name, -1)``, scale rule "even"
    and no rotation.

    Args:
      dtype: logical dtype of pairs without a record (float32, bfloat16 or float16); None
        (default): bfloat16 for those, the recorded one for the others.
      axes: ``{name: axis}``: where K goes (default: the recorded axis, else -1); moving K keeps
        the record (a rotation stays along K).

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: ``path`` is not a safetensors file (truncated, or another format); a
        ``_blocks`` tensor without its ``_scales`` (or the reverse), or a pair of the
        wrong shapes; a record that is malformed, of another format version, of no pair in the
        file, or whose shape does not match its pair; ``dtype`` given for a recorded pair and
        different from its record (the message names both). TypeError: a pair of the wrong
        dtypes. The message names the tensor.
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    if os.path.isdir(path):
        raise ValueError(f"path: {path} is a directory, not a safetensors file")
    try:
        raw = load_file(str(path))
        with safe_open(str(path), framework="np") as f:
            file_meta = f.metadata() or {}
    except SafetensorError as e:  # a truncated or foreign file: say which file and what it is not
        raise ValueError(f"path: {path} is not a readable safetensors file ({e})") from e
    records = {k[len(weight_record.RECORD_KEY_PREFIX):]: v for k, v in file_meta.items()
               if k.startswith(weight_record.RECORD_KEY_PREFIX)}
    axes = dict(axes or {})
    out: dict = {}
    for key in sorted(raw):
        if key.endswith(BLOCKS_SUFFIX):
            name = key[: -len(BLOCKS_SUFFIX)]
            if name + SCALES_SUFFIX not in raw:
                raise ValueError(f"{key}: found no matching {name + SCALES_SUFFIX} tensor in {path}")
            if name in records:
                out[name] = _recorded(name, raw[key], raw[name + SCALES_SUFFIX], records[name], dtype, axes, path)
            else:
                out[name] = from_blocks_scales(raw[key], raw[name + SCALES_SUFFIX],
                                               dtype=jnp.bfloat16 if dtype is None else dtype,
                                               axis=axes.get(name, -1), name=name)
        elif key.endswith(SCALES_SUFFIX):
            if key[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in raw:
                raise ValueError(f"{key}: found no matching {key[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX} tensor in {path}")
        else:
            out[key] = raw[key]
    orphans = sorted(n for n in records if not isinstance(out.get(n), MXFP4Array))
    if orphans:
        raise ValueError(f"{path}: records {orphans} name no {BLOCKS_SUFFIX}/{SCALES_SUFFIX} pair of the file")
    unknown = set(axes) - set(out)
    if unknown:
        raise ValueError(f"axes names tensors that are not MXFP4 pairs in {path}: {sorted(unknown)}")
    return out


def _recorded(name, blocks, scales, text, dtype, axes, path) -> MXFP4Array:
    """The pair ``name`` as saved: its bytes with the record of :func:`save_mxfp4`."""
    rec = weight_record.from_metadata(name, text, str(path))
    if dtype is not None and jnp.dtype(dtype) != rec["dtype"]:
        raise ValueError(f"{name}: load_mxfp4(dtype={jnp.dtype(dtype).name}) but {path} records logical dtype "
                         f"{rec['dtype'].name} for it; leave dtype out to get the recorded one")
    # axes may move K elsewhere (e.g. a stored [N, K] as a Flax [K, N] kernel): the rotation stays
    # along K, so the record still holds; the layers check the moved kernel against their recipe
    q = from_blocks_scales(blocks, scales, dtype=rec["dtype"], axis=axes.get(name, rec["axis"]), name=name)
    k_last = lambda shape, axis: shape[:axis] + shape[axis + 1:] + shape[axis:axis + 1]  # noqa: E731
    if k_last(q.shape, q.axis) != k_last(rec["shape"], rec["axis"]):
        raise ValueError(f"{name}: {path} records logical shape {rec['shape']} (axis {rec['axis']}) but its pair "
                         f"holds {k_last(q.shape, q.axis)} with K last")
    return MXFP4Array(q.data, q.scales, q.axis, q.shape, q.dtype, rec["scale_mode"], "plain",
                      rec["hadamard"]).with_scale_layout(rec["scale_layout"])
