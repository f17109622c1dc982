"""Timing and reporting helpers shared by the benchmarks (no third-party code).

Timing method: each sample runs ``inner`` calls of the measured function back to back inside ONE
jitted program (unrolled, so no host round trip between calls). Every call gets its own operand
buffers (copies where needed): identical calls on identical buffers would be merged by XLA's
common-subexpression elimination, and distinct buffers (at least 3x the L2 in total) also keep
repeated calls from reading operands out of L2. The sample time divided by ``inner`` is one
measurement. After a warm-up (compilation + one untimed run), the reported time is the median of
``reps`` samples. Host dispatch of the program is amortised over ``inner`` calls.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import time

import jax
import numpy as np

L2_BYTES = 64 << 20  # bytes to exceed with rotating operand sets (H200 L2: 60 MB)


def device_info() -> dict:
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def n_sets_for(bytes_per_set: int, cap: int = 8) -> int:
    """Operand copies to rotate so that together they exceed 3x the L2."""
    return max(1, min(cap, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))))


def time_fn(fn, sets, *, reps: int = 30, min_sample_s: float = 2e-3, max_inner: int = 64,
            budget_s: float = 1.5) -> dict:
    """Median seconds per call of ``fn(*args)`` for ``args`` rotating over ``sets``.

    Returns {"median_s", "min_s", "samples", "inner", "reps"}.
    """
    n = len(sets)

    def many(inner):
        def run(all_sets):
            return [fn(*all_sets[i]) for i in range(inner)]

        return jax.jit(run)

    one = many(n)
    jax.block_until_ready(one(sets))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(one(sets))
    est = (time.perf_counter() - t0) / n
    inner = int(min(max_inner, max(n, math.ceil(min_sample_s / max(est, 1e-7)))))
    if inner > n:  # distinct buffers for every call (see the module docstring)
        sets = list(sets) + [
            jax.tree.map(lambda x: jax.numpy.array(x, copy=True), sets[i % n]) for i in range(n, inner)
        ]
        jax.block_until_ready(sets)
    prog = many(inner) if inner != n else one
    jax.block_until_ready(prog(sets))  # compile + warm-up
    reps = int(max(5, min(reps, budget_s / max(est * inner, 1e-7))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(sets))
        samples.append((time.perf_counter() - t0) / inner)
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "samples": reps,
        "inner": inner,
        "reps": reps,
    }


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else float("nan")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))


def out_dir(path):
    os.makedirs(path, exist_ok=True)
    return path


def save_figure(fig, out, name):
    """Tight layout, save ``name`` (PNG, 120 dpi) into ``out``, close; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
