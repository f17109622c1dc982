"""``einsum``: two-operand MXFP4 einsum, mapped onto :func:`jax_mxfp4.dot_general`.

The subscripts are read with NumPy's rules (``"bsd,df->bsf"``; ``...`` for leading dims; without
``->`` the output is every letter seen exactly once, in alphabetical order). Each letter then
plays one ``dot_general`` role:

* in both operands and in the output: a batch dim;
* in both operands, not in the output: a contracting dim (together they form K, quantized in
  blocks of 32 with one E8M0 scale each);
* in one operand and in the output: a free dim (M for lhs, N for rhs).

A letter shared by both operands has one size, except that a batch letter of size 1 in one
operand is broadcast over the other's size, as ``jnp.einsum`` allows (:func:`align_operands`;
e.g. multi-query attention's ``"btnh,bsnh->bnts"`` with one key head, n = 1): it then acts as
a free dim of the other operand.

Anything else is not a single ``dot_general`` and raises a clear ``ValueError``: a letter summed
over one operand only, a letter repeated inside one operand (a diagonal), an output letter absent
from the operands, no contracting letter at all, three or more operands, a contracted letter
of size 1 in one operand only, sizes that differ otherwise. The ``dot_general``
output (batch, lhs free, rhs free) is transposed to the requested order.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np

from .array import MXFP4Array

_LETTERS = string.ascii_letters


def _ndim(x, name) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"einsum: {name} must be an array or an MXFP4Array, got {type(x).__name__}")
    return len(shape)


def _expand_ellipsis(term: str, ndim: int, fill: str, name: str) -> str:
    if "..." not in term:
        return term
    if term.count("...") > 1:
        raise ValueError(f"einsum: {name} subscripts {term!r} have more than one '...'")
    n = ndim - (len(term) - 3)
    if n < 0:
        raise ValueError(f"einsum: {name} subscripts {term!r} name more dims than its rank {ndim}")
    return term.replace("...", fill[len(fill) - n:] if n else "")


def parse_subscripts(subscripts: str, lhs_ndim: int, rhs_ndim: int):
    """``subscripts`` -> ``(dimension_numbers, out_perm)`` for ``dot_general`` plus a transpose.

    ``dimension_numbers`` is ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``;
    ``out_perm`` permutes ``dot_general``'s output (batch, lhs free, rhs free) into the order of
    the output subscripts (None when it is already in that order). Ranks only: size-1
    broadcasting is resolved by :func:`align_operands`, which sees the shapes.

    Raises:
      TypeError: ``subscripts`` not a string.
      ValueError: malformed subscripts or a contraction that is not one ``dot_general`` (see the
        module docstring), with the offending letter named.
    """
    return _dimension_numbers(*_terms(subscripts, lhs_ndim, rhs_ndim), subscripts)


def _terms(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
    """The lhs, rhs and output subscripts with ``...`` expanded and the implicit output made
    explicit, checked letter by letter (module docstring)."""
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum: subscripts must be a str like 'bk,kn->bn', got {type(subscripts).__name__}")
    spec = subscripts.replace(" ", "")
    inputs, arrow, out = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        raise ValueError(
            f"einsum: jax_mxfp4.einsum takes exactly two operands (lhs, rhs), but {subscripts!r} "
            f"names {len(terms)}; contract the others first with jnp.einsum"
        )
    used = set(spec) - {".", ",", "-", ">"}
    bad = sorted(c for c in used if c not in _LETTERS)
    if bad:
        raise ValueError(f"einsum: subscripts {subscripts!r} contain {bad}; use letters a-z, A-Z and '...'")
    fill = "".join(c for c in _LETTERS if c not in used)
    n_ell = max(lhs_ndim - (len(terms[0]) - 3) if "..." in terms[0] else 0,
                rhs_ndim - (len(terms[1]) - 3) if "..." in terms[1] else 0, 0)
    fill = fill[:n_ell]
    lt = _expand_ellipsis(terms[0], lhs_ndim, fill, "lhs")
    rt = _expand_ellipsis(terms[1], rhs_ndim, fill, "rhs")
    for name, term, ndim in (("lhs", lt, lhs_ndim), ("rhs", rt, rhs_ndim)):
        if len(term) != ndim:
            raise ValueError(f"einsum: {name} has rank {ndim} but its subscripts {term!r} name {len(term)} dims")
        for c in set(term):
            if term.count(c) > 1:
                raise ValueError(
                    f"einsum: letter {c!r} appears twice in the {name} subscripts {term!r} (a diagonal "
                    "or trace), which is not a dot_general; take it with jnp.diagonal/jnp.trace first"
                )
    if arrow:
        ot = _expand_ellipsis(out, len(out) - 3 + len(fill), fill, "output") if "..." in out else out
        for c in set(ot):
            if ot.count(c) > 1:
                raise ValueError(f"einsum: letter {c!r} appears twice in the output subscripts {ot!r}")
            if c not in lt and c not in rt:
                raise ValueError(f"einsum: output letter {c!r} is in neither operand ({subscripts!r})")
    else:  # NumPy's implicit output: letters seen once, alphabetical (ellipsis dims first)
        once = sorted(c for c in set(lt + rt) if (lt + rt).count(c) == 1 and c not in fill)
        ot = "".join(c for c in fill if c in lt or c in rt) + "".join(once)
    for name, term, other in (("lhs", lt, rt), ("rhs", rt, lt)):
        for c in term:
            if c not in other and c not in ot:
                raise ValueError(
                    f"einsum: letter {c!r} of {name} is summed over one operand only ({subscripts!r}), "
                    "which is not a dot_general; sum it first (x.sum(axis)) or keep it in the output"
                )
    return lt, rt, ot


def _dimension_numbers(lt: str, rt: str, ot: str, subscripts: str):
    """:func:`parse_subscripts` from checked terms: letters -> dimension numbers and output perm."""
    batch = [c for c in lt if c in rt and c in ot]
    contract = [c for c in lt if c in rt and c not in ot]
    if not contract:
        raise ValueError(
            f"einsum: {subscripts!r} contracts no letter; an MXFP4 GEMM needs a contraction (K). "
            "Use jnp.einsum for an outer or element-wise product"
        )
    lc = tuple(lt.index(c) for c in contract)
    rc = tuple(rt.index(c) for c in contract)
    lb = tuple(lt.index(c) for c in batch)
    rb = tuple(rt.index(c) for c in batch)
    produced = batch + [c for c in lt if c not in rt] + [c for c in rt if c not in lt]
    perm = tuple(produced.index(c) for c in ot)
    return ((lc, rc), (lb, rb)), (None if perm == tuple(range(len(perm))) else perm)


def einsum(subscripts, lhs, rhs, *, precision=None, preferred_element_type=None, recipe=None, key=None):
    """MXFP4 ``jnp.einsum`` for two operands, differentiable (MXFP4 fprop, dgrad and wgrad).

    The contraction is mapped onto :func:`jax_mxfp4.dot_general` (rules in
    :mod:`jax_mxfp4.einsum`): the letters shared by both operands and absent from the output are
    the contracting dims (total length K, a multiple of 32), shared letters kept in the output are
    batch dims. A batch letter of size 1 in one operand is broadcast, as in ``jnp.einsum``
    (:func:`align_operands`).

    Args:
      subscripts: e.g. ``"bsd,dnh->bsnh"``; ``...`` and NumPy's implicit output are accepted.
      lhs, rhs: float32/bfloat16/float16 arrays, or :class:`jax_mxfp4.MXFP4Array` quantized along
        their single contracting dim (forward only).
      precision: the numerics contract, as in :func:`jax_mxfp4.dot_general` (the stricter of it
        and ``recipe.precision`` counts; README "FP8 path").
      preferred_element_type: output dtype (float32, bfloat16, float16); None: what
        ``jnp.einsum`` returns for these dtypes (bfloat16 x bfloat16 -> bfloat16).
      recipe: :class:`jax_mxfp4.Recipe` (default ``Recipe()``).
      key: optional PRNG key for the stochastic rounding of the gradient in the backward pass,
        as in :func:`jax_mxfp4.dot_general` (None: the data-derived fallback key).

    Returns:
      The array ``jnp.einsum(subscripts, lhs, rhs)`` would return (shape in output order), with
      operands quantized to MXFP4 along K.

    Raises:
      ValueError: a contraction that is not one ``dot_general``, malformed subscripts, K not a
        multiple of 32, an MXFP4Array not quantized along its single contracting dim, a shared
        letter whose sizes differ (other than a size-1 batch letter of a float operand).
      TypeError: non-float operands, a bad ``recipe``.
    """
    return _einsum(subscripts, lhs, rhs, preferred_element_type, recipe, pad_k=False, key=key, precision=precision)


def _einsum(subscripts, lhs, rhs, preferred_element_type, recipe, *, pad_k: bool, key=None, precision=None):
    """:func:`einsum`; ``pad_k=True`` zero-pads K to a multiple of 32 (the Flax Einsum layers),
    including a float operand facing an MXFP4Array whose single contracting dim was padded by
    :func:`jax_mxfp4.flax.quantize_params`."""
    from .training import _dot_general

    lhs, rhs, dn, perm = align_operands(subscripts, lhs, rhs, pad_k=pad_k)
    if preferred_element_type is None:  # jnp.einsum promotes the operands first
        preferred_element_type = jnp.result_type(lhs.dtype, rhs.dtype)
    out = _dot_general(lhs, rhs, dn, preferred_element_type, recipe, pad_k=pad_k, key=key, precision=precision)
    return out if perm is None else jnp.transpose(out, perm)


def align_operands(subscripts, lhs, rhs, *, pad_k: bool = False):
    """The size rules of every MXFP4 einsum route (public :func:`einsum`, the Flax Einsum layers,
    the Qwix providers): ``(lhs, rhs, dimension_numbers, out_perm)`` for ``dot_general``.

    A letter shared by both operands has one size, except (as ``jnp.einsum`` allows) a batch
    letter (kept in the output) of size 1 in one operand, which is broadcast: that operand's
    axis is squeezed and the letter becomes a free dim of the other operand (e.g. one key/value
    head ``bsnh`` with n = 1 facing four query heads in ``"btnh,bsnh->bnts"``). With ``pad_k``
    a float operand's single contracting dim is first zero-padded up to a facing quantized
    operand's padded K (:func:`_pad_to_quantized`).

    Raises:
      ValueError: a shared letter whose sizes differ otherwise (naming the letter and sizes),
        including a contracted letter of size 1 in one operand only (``jnp.einsum`` would sum
        the other operand over it first: not one ``dot_general``), or a size-1 batch axis of a
        quantized operand (an MXFP4Array is not broadcast; broadcast the float weight first).
      TypeError/ValueError: as :func:`parse_subscripts`.
    """
    from .gemm import _QUANTIZED

    lt, rt, ot = _terms(subscripts, _ndim(lhs, "lhs"), _ndim(rhs, "rhs"))
    if pad_k:
        (lc, rc), _ = _dimension_numbers(lt, rt, ot, subscripts)[0]
        if len(lc) == 1:
            lhs, rhs = _pad_to_quantized(lhs, lc[0], rhs, rc[0])
    for c in [c for c in lt if c in rt]:
        n_l, n_r = lhs.shape[lt.index(c)], rhs.shape[rt.index(c)]
        if n_l == n_r:
            continue
        where = f"einsum {subscripts!r}: letter {c!r} has size {n_l} in lhs but {n_r} in rhs"
        if 1 not in (n_l, n_r):
            raise ValueError(f"{where} (a shared letter needs one size, or size 1 in one operand to broadcast)")
        if c not in ot:
            raise ValueError(f"{where}: a contracted letter of size 1 in one operand only is a sum of the other "
                             "operand over it, not one dot_general; sum that operand over it first (x.sum(axis))")
        name, x, term = ("lhs", lhs, lt) if n_l == 1 else ("rhs", rhs, rt)
        if isinstance(x, _QUANTIZED) or not isinstance(x, (jax.Array, np.ndarray)):
            raise ValueError(f"{where}: {name} is a quantized {type(x).__name__}, which is not broadcast; "
                             "broadcast or squeeze the float operand before quantizing it")
        x = jnp.squeeze(x, term.index(c))  # broadcast as jnp.einsum does: the letter is now free
        if name == "lhs":
            lhs, lt = x, lt.replace(c, "")
        else:
            rhs, rt = x, rt.replace(c, "")
    dn, perm = _dimension_numbers(lt, rt, ot, subscripts)
    return lhs, rhs, dn, perm


def _pad_to_quantized(lhs, la, rhs, ra):
    """Zero-pad the float operand's contracting dim up to a facing quantized operand's (padded) K
    (an MXFP4Array, or one prepared by :func:`jax_mxfp4.prepare_decode`/``prepare_fp8``)."""
    from .gemm import _QUANTIZED

    for q, f, fa, swap in ((rhs, lhs, la, False), (lhs, rhs, ra, True)):
        if isinstance(q, _QUANTIZED) and not isinstance(f, _QUANTIZED):
            kq, kf = q.shape[q.axis], f.shape[fa]
            if kf < kq and -(-kf // 32) * 32 == kq:
                widths = [(0, 0)] * f.ndim
                widths[fa] = (0, kq - kf)
                f = jnp.pad(f, widths)
                return (q, f) if swap else (f, q)
    return lhs, rhs
