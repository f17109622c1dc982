"""Quantize two matrices to MXFP4, multiply them, and compare with the float32 product.

Run from a checkout, with the package installed:
``python examples/quickstart.py [--m 256 --n 512 --k 1024 --scale-mode even --backend auto]``
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_mxfp4 as mx


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--scale-mode", default="even", choices=["floor", "ceil", "even", "rceil"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    kx, kw = jax.random.split(jax.random.key(args.seed))
    x = jax.random.normal(kx, (args.m, args.k), jnp.float32)
    w = jax.random.normal(kw, (args.k, args.n), jnp.float32)
    recipe = mx.Recipe(scale_mode=args.scale_mode, backend=args.backend)
    dims = (((1,), (0,)), ((), ()))

    xq = mx.quantize(x, axis=1, scale_mode=args.scale_mode)
    wq = mx.quantize(w, axis=0, scale_mode=args.scale_mode)
    y = jax.jit(lambda a, b: mx.dot_general(a, b, dims, recipe=recipe))(xq, wq)
    y_float = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    y_deq = np.asarray(mx.dequantize(xq), np.float64) @ np.asarray(mx.dequantize(wq), np.float64)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    print(mx.explain(xq, wq, dims, recipe=recipe))
    print(f"x: {x.shape} float32 -> {xq}  ({xq.nbytes} bytes vs {x.nbytes} as float32)")
    print(f"w: {w.shape} float32 -> {wq}")
    print(f"relative Frobenius error vs float32 product:           {rel(np.asarray(y), y_float):.4e}")
    print(f"relative Frobenius error vs float64 product of MXFP4:  {rel(np.asarray(y), y_deq):.4e}")
    x_rt = rel(np.asarray(mx.dequantize(xq), np.float64), np.asarray(x, np.float64))
    print(f"quantization round-trip error of x:                    {x_rt:.4e}")


if __name__ == "__main__":
    main()
