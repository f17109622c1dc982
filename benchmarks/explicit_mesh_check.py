"""Explicit-sharding meshes on real devices: the cases of issue 11 against the single-device run.

For every device count it can form (all devices, 2 at least), on ``AxisType.Explicit`` and
``AxisType.Auto`` meshes, with backend "auto" (on CUDA: pallas for small GEMMs, scaled_dot for
large ones) and "pallas" (compiled), it runs:
  - a0:     dense(x [D, 64, 64] on P("data", None, None), w [64, 32] made outside the mesh),
            forward and gradients;
  - a:      dot_general(bf16 [16, 256] on P("data", None), bf16 [256, 512]), forward;
  - b:      gradients of sum(dot_general(x [64, 256] on P("data"), w [256, 48] on P(None, "model"))**2)
            (dY's N = 48 split over "model": dgrad regathers N), grad_rounding="nearest";
  - tokens: a flax linen Dense training step with 48 and 100 tokens per device (stochastic
            rounding, one step key).
Pass: no error, output sharding as in plain JAX (a0, a), and every value within 1e-5 of the
largest magnitude of the single-device run (float32 reassociation level, as tests/test_sharding.py;
a wrong block, axis or key is off by ~1e-1), plus one bf16 ulp (2^-7) for bf16 outputs.

Usage: python benchmarks/explicit_mesh_check.py [--quick] [--out DIR]; exits 1 if any check fails.
(--quick: 8 simulated CPU devices, backend "pallas" interpreted.)
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

if "--quick" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import device_info, out_dir, write_json  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def close(got, want, bf16=False):
    """(ok, max |got - want|, bound): the tolerance of the module docstring."""
    got = [np.asarray(g, np.float64) for g in jax.tree.leaves(got)]
    want = [np.asarray(w, np.float64) for w in jax.tree.leaves(want)]
    err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    bound = (2.0**-7 if bf16 else 1e-5) * max(float(np.abs(w).max()) for w in want)
    return err <= bound, err, bound


def spec(x):
    s = tuple(jax.typeof(x).sharding.spec)
    return s + (None,) * (x.ndim - len(s))


def case_a0(mesh, d, recipe):
    x, w = normal(1, (d, 64, 64)), normal(2, (64, 32), scale=0.1)
    f = lambda a, b: mx.dense(a, b, recipe=recipe)  # noqa: E731
    g = jax.grad(lambda a, b: jnp.sum(f(a, b) * jnp.arange(32.0)), argnums=(0, 1))
    want = (jax.jit(f)(x, w), jax.jit(g)(x, w))
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        got = (jax.jit(f)(xx, w), jax.jit(g)(xx, w))
        plain = jax.jit(lambda a, b: a @ b)(xx, w)
    ok, err, bound = close(got, want)
    return ok and spec(got[0]) == spec(plain), err, bound, f"out {spec(got[0])} plain {spec(plain)}"


def case_a(mesh, d, recipe):
    x, w = normal(3, (16, 256), jnp.bfloat16), normal(4, (256, 512), jnp.bfloat16)
    f = lambda a, b: mx.dot_general(a, b, DIMS, recipe=recipe)  # noqa: E731
    want = jax.jit(f)(x, w)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        got = jax.jit(f)(xx, w)
        plain = jax.jit(lambda a, b: a @ b)(xx, w)
    ok, err, bound = close(got, want, bf16=True)
    return ok and spec(got) == spec(plain), err, bound, f"out {spec(got)} plain {spec(plain)}"


def case_b(mesh, d, recipe):
    x, w = normal(5, (64, 256)), normal(6, (256, 48), scale=0.1)
    rec = recipe.replace(grad_rounding="nearest")
    loss = lambda a, b: jnp.sum(mx.dot_general(a, b, DIMS, recipe=rec) ** 2)  # noqa: E731
    g = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(g)(x, w)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ww = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        got = jax.jit(g)(xx, ww)
    return (*close(got, want), "")


def case_tokens(mesh, d, recipe, tokens):
    from jax_mxfp4.flax import linen as mxl

    model = mxl.Dense(32, recipe=recipe)
    x, t = normal(7, (d * tokens, 64)), normal(8, (d * tokens, 32))
    params = model.init(jax.random.key(0), x)
    rngs = {"stochastic_rounding": jax.random.key(9)}
    step = jax.grad(lambda p, a, b: jnp.sum((model.apply(p, a, rngs=rngs) - b) ** 2))
    want = jax.jit(step)(params, x, t)
    with jax.set_mesh(mesh):
        s = NamedSharding(mesh, P("data", None))
        got = jax.jit(step)(params, jax.device_put(x, s), jax.device_put(t, s))
    return (*close(got, want), "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 simulated CPU devices (CI)")
    p.add_argument("--out", default="benchmarks/results/explicit_mesh")
    args = p.parse_args(argv)
    n = len(jax.devices())
    if n < 2:
        print(f"needs at least 2 devices, JAX sees {n}")
        return 1
    d = 2
    rows = []
    for style in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((d, max(1, n // d) if n >= 4 else 1), ("data", "model"), axis_types=(style,) * 2)
        if n < 4:  # 2 devices: "model" carries the split for case b
            mesh_b = jax.make_mesh((1, 2), ("data", "model"), axis_types=(style,) * 2, devices=jax.devices()[:2])
        else:
            mesh_b = mesh
        for backend in ("auto", "pallas"):
            recipe = mx.Recipe(backend=backend)
            cases = [("a0", lambda: case_a0(mesh, d, recipe)), ("a", lambda: case_a(mesh, d, recipe)),
                     ("b", lambda: case_b(mesh_b, d, recipe))]
            cases += [(f"tokens-{t}", lambda t=t: case_tokens(mesh, d, recipe, t)) for t in (48, 100)]
            for name, run in cases:
                try:
                    ok, err, bound, note = run()
                except Exception as e:  # report every case, then fail
                    ok, err, bound, note = False, float("nan"), float("nan"), f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
                rows.append({"mesh": str(style).split(".")[-1], "backend": backend, "case": name, "ok": bool(ok),
                             "max_err": err, "bound": bound, "note": note})
                print(f"{rows[-1]['mesh']:>8} {backend:>6} {name:>10} {'PASS' if ok else 'FAIL'} "
                      f"err {err:.3e} bound {bound:.3e} {note}", flush=True)
    out = out_dir(args.out)
    write_json(os.path.join(out, "explicit_mesh_check.json"), {"info": device_info(), "devices": n, "rows": rows})
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
