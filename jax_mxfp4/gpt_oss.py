"""gpt-oss expert weights: the published ``_blocks``/``_scales`` safetensors layout, read into and
written from :class:`jax_mxfp4.MXFP4Array` byte for byte (nothing is dequantized or re-quantized).

Layout, per expert projection (e.g. ``model.layers.0.mlp.experts.gate_up_proj`` and
``model.layers.0.mlp.experts.down_proj``), for E experts, N output rows and contraction axis K:

* ``{name}_blocks``: uint8 ``[E, N, K/32, 16]``: one block of 32 E2M1 codes per 16 bytes; byte j
  of a block holds element 2j in its low nibble (bits 0-3) and element 2j+1 in its high nibble
  (bits 4-7);
* ``{name}_scales``: uint8 ``[E, N, K/32]``: the block's E8M0 byte b, scale 2^(b - 127).

Element value = ``FP4_VALUES[code] * 2**(b - 127)`` with ``FP4_VALUES = [+0, 0.5, 1, 1.5, 2, 3, 4,
6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]`` (code bit 3 is the sign).

Sources: OpenAI gpt-oss ``gpt_oss/torch/weights.py`` (``FP4_VALUES``; ``Checkpoint._get_mxfp4_tensor``:
``idx_lo = blk & 0x0F`` fills the even elements ``out[:, 0::2]``, ``idx_hi = blk >> 4`` the odd
ones ``out[:, 1::2]``, then ``ldexp(out, scales - 127)``); Hugging Face transformers
``integrations/mxfp4.py`` (the same table and code in ``convert_moe_packed_tensors``;
``Mxfp4GptOssExperts``: ``gate_up_proj_blocks`` ``[E, 2*intermediate, hidden/32, 16]``,
``down_proj_blocks`` ``[E, hidden, intermediate/32, 16]``).

This is :class:`MXFP4Array`'s own packing (:mod:`jax_mxfp4.mx_format`: element 2i in bits 0-3,
the E2M1 table of OCP MX v1.0 §5.3.3, which equals ``FP4_VALUES``; scales ``float8_e8m0fnu``, the
same bytes), so a pair becomes an MXFP4Array of logical shape ``[E, N, K]`` quantized along axis 2
by a reshape ``[..., K/32, 16] -> [..., K/2]`` and a bitcast of the scales; writing reverses it.

Scale bytes are kept as they are. Byte 0xFF is NaN in E8M0 (OCP MX v1.0 §5.4.1):
:func:`jax_mxfp4.dequantize` gives NaN for the block's 32 elements (the PyTorch decoders above
compute ``ldexp(v, 255 - 127)`` instead, an overflow rather than the E8M0 NaN). Byte 0xFE is 2^127: decoded
magnitudes of 2 and above overflow float32 to ±inf. Byte 0x00 is 2^-127: decoded values below
2^-126 become signed zeros (dequantize's rule).

Names: the Hugging Face files use ``{name}_blocks``/``{name}_scales``; the original OpenAI files
(``PARAM_NAME_MAP`` in ``gpt_oss/torch/weights.py``) use ``{name}.blocks``/``{name}.scales``:
pass ``sep="."``. Needs the ``safetensors`` package (``pip install ".[checkpoint]"``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from .array import MXFP4Array
from .checkpoint import from_blocks_scales, to_blocks_scales

BLOCKS, SCALES = "blocks", "scales"
EXPERT_NDIM = 3  # logical [E, N, K]


def from_gpt_oss(blocks, scales, dtype=jnp.bfloat16, *, name: str = "weight") -> MXFP4Array:
    """gpt-oss (blocks, scales) -> ``MXFP4Array`` of logical shape [E, N, K], quantized along axis 2.

    Args:
      blocks: uint8 ``[E, N, K/32, 16]`` (NumPy or JAX), two E2M1 codes per byte, element 2j in
        the low nibble (see the module docstring for the sources).
      scales: uint8 (or ``float8_e8m0fnu``) ``[E, N, K/32]``, E8M0 bytes (bias 127).
      dtype: the logical dtype recorded in the result (bfloat16 (default), float32 or float16).
      name: the weight's name, used in error messages.

    Exact: the bytes are only reshaped; nothing is decoded.

    Raises:
      ValueError: ``blocks`` not of rank 4 or its last dim not 16; ``scales`` not of shape
        ``blocks.shape[:-1]``. TypeError: ``blocks`` not uint8, ``scales`` neither uint8 nor
        float8_e8m0fnu; ``dtype`` not a supported float. Each message names the tensor.
    """
    shape = np.shape(blocks)
    if len(shape) != EXPERT_NDIM + 1:
        raise ValueError(f"{name}_{BLOCKS}: blocks must have shape [E, N, K/32, 16] (the gpt-oss expert layout, "
                         f"rank 4), got {tuple(shape)}; for other ranks use jax_mxfp4.checkpoint.from_blocks_scales")
    return from_blocks_scales(blocks, scales, dtype=dtype, axis=-1, name=name)


def to_gpt_oss(w: MXFP4Array) -> tuple[np.ndarray, np.ndarray]:
    """``MXFP4Array`` [E, N, K] quantized along K -> (blocks uint8 [E, N, K/32, 16], scales uint8
    [E, N, K/32]) in the gpt-oss layout, as NumPy arrays. Swizzled scales are un-swizzled first.
    Exact: only bytes are moved.

    Raises:
      TypeError: ``w`` is not an MXFP4Array.
      ValueError: ``w`` is not 3-D, is quantized along another axis than the last (the layout
        has K last; the bytes of another axis would describe the transposed weight), or carries
        a Hadamard rotation (the layout cannot record it; a reader would decode rotated values).
    """
    return _to_gpt_oss(w, "w")


def _to_gpt_oss(w, what: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(w, MXFP4Array):
        raise TypeError(f"{what} must be an MXFP4Array, got {type(w).__name__}")
    if w.ndim != EXPERT_NDIM:
        raise ValueError(f"{what}: gpt-oss expert weights have logical shape [E, N, K] (3 dims), got {w.shape}")
    if w.axis != EXPERT_NDIM - 1:
        raise ValueError(f"{what} is quantized along axis {w.axis} of shape {w.shape}; the gpt-oss layout is "
                         f"quantized along the last axis K of [E, N, K]: quantize the [E, N, K] weight along axis 2")
    if w.hadamard is not None:
        raise ValueError(f"{what} was quantized after a Hadamard rotation {w.hadamard}, which the gpt-oss layout "
                         "cannot record (a reader would decode rotated values); use jax_mxfp4.checkpoint.save_mxfp4")
    return to_blocks_scales(w)


def load_gpt_oss(path, names: Sequence[str] | None = None, *, dtype=jnp.bfloat16, extra: bool = False,
                 sep: str = "_"):
    """Read gpt-oss expert weights from safetensors file(s) without dequantizing them.

    Every ``{stem}{sep}blocks``/``{stem}{sep}scales`` pair becomes ``{stem}: MXFP4Array`` of
    logical shape [E, N, K] quantized along axis 2 (:func:`from_gpt_oss`); only the tensors asked
    for are read.

    Args:
      path: a safetensors file, or a sequence of them (the shards of one checkpoint: a pair may
        have its two tensors in different shards).
      names: the stems to read, a sequence of str or one str (default: every pair).
      dtype: logical dtype of the results (bfloat16 (default), float32 or float16).
      extra: also return every tensor that is not part of a pair (biases, norms, attention and
        embedding weights), as NumPy arrays under their own names.
      sep: the separator before ``blocks``/``scales``: "_" (Hugging Face files) or "." (the
        original OpenAI files).

    Returns:
      ``{stem: MXFP4Array}``; with ``extra=True``, ``(weights, others)`` with ``others`` a
      ``{name: np.ndarray}``.

    Raises:
      FileNotFoundError: no file at a path.
      ValueError: a path that is not a safetensors file (another format, truncated, empty); a
        tensor name found in two shards; a ``blocks`` tensor without its ``scales`` partner or
        the reverse; a name in ``names`` that is no pair; a pair of the wrong shapes (rank, last
        dim 16, scales not ``blocks.shape[:-1]``). TypeError: a pair of the wrong dtypes. Each
        message names the path or the tensor.
    """
    files = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    where = _index(files)
    b_suffix, s_suffix = sep + BLOCKS, sep + SCALES
    stems = {k[: -len(b_suffix)] for k in where if k.endswith(b_suffix)}
    scale_stems = {k[: -len(s_suffix)] for k in where if k.endswith(s_suffix)}
    for stem in sorted(stems ^ scale_stems):
        have, lack = (b_suffix, s_suffix) if stem in stems else (s_suffix, b_suffix)
        raise ValueError(f"{stem}{have}: found no matching {stem}{lack} tensor in {_shown(files)}")
    wanted = sorted(stems) if names is None else [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in stems]
    if unknown:
        raise ValueError(f"names: {unknown} are not {b_suffix}/{s_suffix} pairs in {_shown(files)} "
                         f"(pairs there: {sorted(stems)[:8]}{' ...' if len(stems) > 8 else ''})")
    weights = {n: from_gpt_oss(_read(where, n + b_suffix), _read(where, n + s_suffix), dtype, name=n)
               for n in wanted}
    if not extra:
        return weights
    paired = {n + suffix for n in stems for suffix in (b_suffix, s_suffix)}
    return weights, {k: _read(where, k) for k in sorted(where) if k not in paired}


def save_gpt_oss(path, weights: Mapping[str, MXFP4Array], extra: Mapping | None = None, *,
                 metadata: Mapping[str, str] | None = None, sep: str = "_") -> None:
    """Write ``weights`` in the gpt-oss layout to one safetensors file: each ``{name: w}`` as
    ``{name}{sep}blocks``/``{name}{sep}scales`` (:func:`to_gpt_oss`), each ``extra`` tensor
    (NumPy/JAX array) under its own name, and ``metadata`` (str -> str; files written by Hugging Face
    transformers carry ``{"format": "pt"}``) in the header. No jax_mxfp4 record is written: the file holds
    what the published layout holds, and :func:`load_gpt_oss` reads it back byte for byte.

    Raises:
      TypeError: a non-str name; a weight that is not an MXFP4Array; an MXFP4Array in ``extra``.
      ValueError: a weight :func:`to_gpt_oss` refuses (not [E, N, K] quantized along K, or
        rotated); an ``extra`` name ending in ``{sep}blocks``/``{sep}scales`` (it would be read
        back as half of a pair) or equal to a pair's tensor.
    """
    from safetensors.numpy import save_file

    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        _check_name(name, "weights")
        blocks, scales = _to_gpt_oss(w, f"weights[{name!r}]")
        out[name + sep + BLOCKS], out[name + sep + SCALES] = blocks, scales
    for name, a in (extra or {}).items():
        _check_name(name, "extra")
        if isinstance(a, MXFP4Array):
            raise TypeError(f"extra[{name!r}] is an MXFP4Array; pass it in weights")
        if name.endswith((sep + BLOCKS, sep + SCALES)) or name in out:
            raise ValueError(f"extra[{name!r}]: a name ending in {sep + BLOCKS!r}/{sep + SCALES!r} is read back as "
                             "half of an MXFP4 pair (or is one of weights' tensors); rename it")
        out[name] = np.ascontiguousarray(np.asarray(a))
    save_file(out, str(path), metadata=dict(metadata) if metadata else None)


def _check_name(name, what: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{what}: tensor names must be str, got {name!r}")


def _index(files) -> dict[str, str]:
    """{tensor name: file} over ``files`` (headers only; no tensor is read)."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for p in files:
        p = os.fspath(p)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"path: no file at {p}")
        with _readable(p):
            with safe_open(p, framework="np") as f:
                keys = list(f.keys())
        for k in keys:
            if k in where:
                raise ValueError(f"{k}: found in two files, {where[k]} and {p}")
            where[k] = p
    return where


def _read(where: Mapping[str, str], key: str) -> np.ndarray:
    from safetensors import safe_open

    with _readable(where[key]):
        with safe_open(where[key], framework="np") as f:
            return f.get_tensor(key)


@contextlib.contextmanager
def _readable(path: str):
    """safetensors' error for a foreign or truncated file as a ValueError naming the file (as
    :func:`jax_mxfp4.checkpoint.load_mxfp4` reports it)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise ValueError(f"path: {path} is not a readable safetensors file ({e})") from e


def _shown(files) -> str:
    return os.fspath(files[0]) if len(files) == 1 else f"{len(files)} files ({os.fspath(files[0])}, ...)"
