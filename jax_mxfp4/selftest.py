"""``python -m jax_mxfp4.selftest``: every available backend against an exact reference, then a
speed table against bf16 ``dot_general``, on whatever device JAX sees (gfx950 for "hipblaslt").

Correctness. Operands are MXFP4Arrays with random codes and scales; the reference is the exact
float64 product of their dequantized values (NumPy, independent of every backend). A backend
passes when |out - exact| <= g(K) * S + r(out) elementwise, where S = |A| |B|^T, u = 2^-24,
g(n) = n u / (1 - n u) bounds any float32 summation order of K exact products, and r is half an
ulp of the output dtype at |exact| (bf16: 2^-8 |exact|, f16: 2^-11 |exact|, plus subnormal
spacing). The hipBLASLt kernels accumulate in float32 (compute type 32F), so they must pass too.

Exit status: 0 when every case that ran passed, 1 otherwise. Options: --quick (small shapes only),
--no-speed, --iters N.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import dispatch
from .array import MXFP4Array
from .gemm import dot_general
from .recipe import Recipe

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
DN = (((1,), (1,)), ((), ()))
U = 2.0**-24
OUT_EPS = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
OUT_TINY = {"float32": 0.0, "bfloat16": 2.0**-133, "float16": 2.0**-24}


def _random_mx(rng, rows, k):
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 133, (rows, k // 32), dtype=np.uint8)
    q = MXFP4Array(jnp.asarray(data), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), 1, (rows, k), jnp.float32)
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(rows, k)
    exact = E2M1[codes] * np.ldexp(1.0, np.repeat(scales.astype(np.int64), 32, axis=1) - 127)
    return q, exact


def _g(n):
    return n * U / (1 - n * U)


def check_case(backend, m, n, k, layout, out, seed=0):
    """(status, detail) for one backend and GEMM: "PASS", "FAIL" or "SKIP"."""
    rng = np.random.default_rng(seed)
    (a, ea), (b, eb) = _random_mx(rng, m, k), _random_mx(rng, n, k)
    recipe = Recipe(backend=backend, scale_layout=layout)
    try:
        decision = dispatch.decide(dispatch_problem(a, b, out, recipe), backend)
        del decision
    except dispatch.BackendUnavailableError as e:
        return "SKIP", str(e).split(": ", 1)[-1][:90]
    try:
        got = jax.jit(lambda x, y: dot_general(x, y, DN, preferred_element_type=getattr(jnp, out), recipe=recipe))(a, b)
        got = np.asarray(got).astype(np.float64)
    except Exception as e:  # report, never crash the table
        return "FAIL", f"{type(e).__name__}: {str(e)[:120]}"
    exact = ea @ eb.T
    acc = _g(k) * (np.abs(ea) @ np.abs(eb).T)
    bound = acc + OUT_EPS[out] * (np.abs(exact) + acc) + OUT_TINY[out]
    err = np.abs(got - exact)
    ok = bool(np.all(err <= bound))
    worst = float(np.max(err / np.maximum(bound, 1e-300)))
    return ("PASS" if ok else "FAIL"), f"max err/bound = {worst:.3g}"


def dispatch_problem(a, b, out, recipe):
    from .backends.base import GemmProblem

    return GemmProblem(1, a.shape[0], b.shape[0], a.shape[1], np.dtype(getattr(jnp, out)), recipe.scale_layout,
                       dispatch.current_platform())


def _time(fn, args, iters):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def speed_table(backends, shapes, iters):
    rows = []
    for m, n, k in shapes:
        rng = np.random.default_rng(1)
        (a, _), (b, _) = _random_mx(rng, m, k), _random_mx(rng, n, k)
        xa = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        xb = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
        base = _time(jax.jit(lambda x, y: jax.lax.dot_general(x, y, DN)), (xa, xb), iters)
        rows.append((f"{m}x{n}x{k}", "bf16 dot_general", base, 2 * m * n * k / base / 1e12, 1.0))
        for name in backends:
            recipe = Recipe(backend=name)
            fn = jax.jit(lambda x, y, r=recipe: dot_general(x, y, DN, preferred_element_type=jnp.bfloat16, recipe=r))
            try:
                t = _time(fn, (a, b), iters)
            except Exception as e:
                rows.append((f"{m}x{n}x{k}", name, float("nan"), float("nan"), f"error: {str(e)[:60]}"))
                continue
            rows.append((f"{m}x{n}x{k}", name, t, 2 * m * n * k / t / 1e12, t / base))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_mxfp4.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed table")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)

    platform = dispatch.current_platform()
    devices = jax.devices()
    print(f"jax {jax.__version__}; platform {platform}; devices: {[d.device_kind for d in devices]}")
    if platform == "rocm":
        from .ffi import hipblaslt_status

        st = hipblaslt_status()
        print(f"hipBLASLt: loaded={st.get('loaded')} path={st.get('hipblaslt_path')} error={st.get('error') or '-'}")
        for d in st.get("devices", []):
            v = d.get("hipblaslt_version", 0)
            print(f"  device {d['ordinal']}: {d['arch']} hipBLASLt {v // 100000}.{v // 100 % 1000}.{v % 100} {d['error']}")
    names = [n for n in dispatch._REGISTRY if n != "xla"] + ["xla"]
    unavailable = {n: dispatch.get_backend(n).unavailable_reason() for n in names}
    for n, why in unavailable.items():
        if why:
            print(f"  backend {n}: unavailable ({why})")
    backends = [n for n in names if not unavailable[n]]

    shapes = [(32, 32, 256), (64, 48, 384)] + ([] if args.quick else [(256, 256, 1024), (512, 256, 2048)])
    print("\ncorrectness vs exact float64 (bound: g(K)|A||B|^T + half an output ulp)")
    print(f"{'backend':<11} {'M x N x K':<15} {'scales':<9} {'out':<9} result  detail")
    failures = 0
    for name in backends:
        for m, n, k in shapes:
            for layout in ("plain", "swizzled"):
                for out in ("float32", "bfloat16"):
                    status, detail = check_case(name, m, n, k, layout, out)
                    failures += status == "FAIL"
                    print(f"{name:<11} {f'{m}x{n}x{k}':<15} {layout:<9} {out:<9} {status:<7} {detail}")

    if not args.no_speed:
        big = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)] if platform != "cpu" else [(256, 256, 1024)]
        if args.quick:
            big = big[:1]
        print("\nspeed (bf16 out, pre-quantized operands; median of", args.iters, "single calls, launch cost "
              "included: indicative only, benchmarks/gemm.py times fairly)")
        print(f"{'M x N x K':<17} {'backend':<17} {'ms':>9} {'TFLOP/s':>9} {'time/bf16':>10}  (< 1 is faster)")
        for shape, name, t, tflops, ratio in speed_table(backends, big, args.iters):
            r = ratio if isinstance(ratio, str) else f"{ratio:.2f}x"
            print(f"{shape:<17} {name:<17} {t * 1e3:>9.3f} {tflops:>9.2f} {r:>9}")
    print(f"\n{'FAILED' if failures else 'OK'}: {failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
