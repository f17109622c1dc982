"""Timing and reporting shared by the benchmarks (no third-party code).

Timing method ("fair timing", README "GPU speed"): one jitted program runs the measured function
on ``calls`` distinct operand sets back to back (unrolled; the function is jitted once, so every
call site shares one lowering). ``calls`` is grown until one program takes >= ``min_program_s``
(20 ms by default), so the host cost of launching the program (a few hundred microseconds with
many buffers) is amortised to ~1-2% even where one call takes 40 us. Operands:
  * the caller's ``sets`` are distinct random operand sets whose bytes together exceed 3x the
    L2 (``n_sets_for``); calls rotate over them, so no call finds its operands in L2 (between two
    uses of a set, the other sets stream > 2x L2 through the cache);
  * every extra call beyond ``len(sets)`` gets its own copy of the set's smallest operand, so no
    two calls are identical and XLA cannot merge them (common-subexpression elimination).
Time per call = program time / calls; the reported figure is the median over ``reps`` programs
after a warm-up. ``kernel_time`` cross-checks one program against the profiler's device kernel
times (sum of every kernel the program ran, divided by ``calls``) and its timeline.

What the time per call still holds (NVIDIA H200, jax 0.11.2, 2026-12-01, ``gemm.py --profile``
with the timed program's own call count): the host's dispatch of the program's arguments, which grows with the
calls (each call brings its own operands), so growing the program does not amortise it. At
16x8192x8192 the GPU ran the calls back to back (idle < 1 us per call) in 19.75 us per call for
the w4a16 kernel and 38.5 us for bf16, while the program time gave 36.3 and 49.5 us: ~11-16 us
per call before the first kernel starts. Decode-size ratios from ``time_fn`` are therefore pulled
toward 1; ``gemm.py --profile`` prints the GPU's part (the timeline span per call) beside them.
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
OUT_ROOT = "bench_out"  # default output root (git-ignored), relative to the working directory


def default_out(name: str) -> str:
    """The default ``--out`` folder of benchmark ``name``: ``bench_out/<name>`` (never the source tree)."""
    return os.path.join(OUT_ROOT, name)


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


def _with_distinct_calls(sets, calls):
    """``calls`` operand tuples rotating over ``sets``; from the second round on, the smallest
    leaf of each tuple is a fresh copy so that every call differs from every other."""
    sets = list(sets)
    out = list(sets[:calls])
    for i in range(len(sets), calls):
        leaves, tree = jax.tree.flatten(sets[i % len(sets)])
        j = min(range(len(leaves)), key=lambda t: leaves[t].size * leaves[t].dtype.itemsize)
        leaves = list(leaves)
        leaves[j] = jax.numpy.array(leaves[j], copy=True)
        out.append(jax.tree.unflatten(tree, leaves))
    jax.block_until_ready(out)
    return out


def _program(fn, calls):
    def run(all_sets):
        return [fn(*all_sets[i]) for i in range(calls)]

    return jax.jit(run)


def time_fn(fn, sets, *, reps: int = 5, min_program_s: float = 0.02, max_calls: int = 1024,
            calls: int | None = None, profile_calls: int = 0) -> dict:
    """Median seconds per call of ``fn(*args)``, fair timing (module docstring).

    Args:
      fn: function of one operand tuple (jitted here once).
      sets: list of distinct operand tuples, together > 3x the L2 (``n_sets_for``).
      reps: programs timed after the warm-up (median reported).
      min_program_s: grow the number of calls per program until one program takes this long.
      max_calls: cap on calls per program (memory: each extra call copies the smallest operand).
      calls: calls in the first program (default ``len(sets)``; fewer: one long call, e.g. a whole
        training step, need not be compiled ``len(sets)`` times over). Calls beyond ``len(sets)``
        differ only in the copied smallest operand; where that operand does not reach the whole
        call (a step counter), XLA may merge the rest of two calls: give as many sets as the
        program may grow to.
      profile_calls: > 0: afterwards, run the timed program (no new compile) under the profiler
        until at least this many calls ran, the programs enqueued back to back as a loop of steps
        runs them (``device_kernel_times``).
    Returns:
      {"median_s", "min_s", "calls", "program_s", "reps", "method": "fair"}; with
      ``profile_calls`` also "profile": {"kernels": {name: device seconds per call}, "timeline":
      per call (``device_kernel_times``), "calls_profiled"}, or {"error": ...} where the profile has
      no GPU kernel events (e.g. on CPU).
    """
    fn = jax.jit(fn)
    base = list(sets)
    calls = min(calls or len(base), max_calls)
    sets = _with_distinct_calls(base, calls)
    prog = _program(fn, calls)
    jax.block_until_ready(prog(sets))  # compile + warm-up
    while True:  # grow until one program takes min_program_s (the first estimate carries launch cost)
        t0 = time.perf_counter()
        jax.block_until_ready(prog(sets))
        took = time.perf_counter() - t0
        if took >= min_program_s or calls >= max_calls:
            break
        calls = int(min(max_calls, max(calls + 1, math.ceil(1.2 * calls * min_program_s / took))))
        sets = _with_distinct_calls(base, calls)
        prog = _program(fn, calls)
        jax.block_until_ready(prog(sets))  # compile + warm-up
    samples = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(sets))
        samples.append(time.perf_counter() - t0)
    med = statistics.median(samples)
    out = {"median_s": med / calls, "min_s": min(samples) / calls, "calls": calls,
           "program_s": med, "reps": len(samples), "method": "fair"}
    if profile_calls > 0:
        runs = math.ceil(profile_calls / calls)

        def run():
            for _ in range(runs):  # enqueued without waiting: each run's outputs freed by the next
                res = prog(sets)
            jax.block_until_ready(res)

        timeline: dict = {}
        per_kernel = device_kernel_times(run, per=runs * calls, timeline=timeline)
        out["profile"] = ({"kernels": per_kernel, "timeline": timeline, "calls_profiled": runs * calls} if per_kernel
                          else {"error": "no GPU kernel events in the profile"})
    return out


def busy_span(intervals) -> tuple[float, float]:
    """(span, busy) of (start, end) intervals: last end - first start, and the length of their
    union (overlapping kernels counted once)."""
    spans = sorted(intervals)
    if not spans:
        return 0.0, 0.0
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return max(e for _, e in spans) - spans[0][0], busy


def device_kernel_times(run, per: float = 1.0, timeline: dict | None = None) -> dict | None:
    """Run ``run()`` under the JAX profiler and return {kernel name: total device seconds / per}
    from the GPU planes' stream lines (kernel launches; summary lines of XLA ops/modules are
    skipped), or None where the profile has no GPU kernel events (e.g. on CPU).

    ``timeline``: a dict filled with where the GPU's time went (all seconds / ``per``):
    "span_s" (first kernel start to last kernel end), "busy_s" (union of kernel intervals),
    "idle_s" (span - busy: the GPU waiting between kernels, e.g. for the host to launch them) and
    "kernels" (events per ``per``)."""
    import glob
    import tempfile

    d = tempfile.mkdtemp(prefix="jax_mxfp4_prof_")
    jax.profiler.start_trace(d)
    run()
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    per_kernel: dict = {}
    spans: list = []
    for f in files[:1]:
        for plane in jax.profiler.ProfileData.from_file(f).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                for ev in line.events:
                    per_kernel[ev.name] = per_kernel.get(ev.name, 0.0) + ev.duration_ns * 1e-9 / per
                    spans.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    if timeline is not None and spans:
        span, busy = busy_span(spans)
        timeline.update(span_s=span * 1e-9 / per, busy_s=busy * 1e-9 / per, idle_s=(span - busy) * 1e-9 / per,
                        kernels=len(spans) / per)
    return per_kernel or None


KERNEL_CATEGORIES = (
    # (category, regular expressions searched in the lower-cased kernel name); the first match wins.
    # Our Pallas kernels by their pallas_call name= (jax_mxfp4/kernels; Triton appends "__N"), our
    # Mosaic GPU kernels (only the w4a16 GEMMs use plgpu.kernel) as "<body>_mosaic_gpu_kernel".
    ("gemm", (r"mxfp4_wgemm", r"mxfp4_decode_bf16", r"_mosaic_gpu", r"gemm", r"nvjet", r"xmma", r"cublas",
              r"cutlass", r"cudnn", r"(^|_)dot(_|$)")),
    ("quantize", (r"mxfp4_quantize", r"mxfp4_encode",
                  # XLA fusions doing bit work: E2M1/E8M0 packing and stochastic-rounding uniforms
                  r"shift_(left|right)", r"(^|_)(xor|popcnt|clz)(_|$)", r"rng", r"threefry")),
    ("rescale / exact rows", (r"mxfp4_fp8_rescale", r"mxfp4_fp8_exact_rows", r"mxfp4_fp8_fix")),
    ("transpose / copy", (r"transpose", r"copy", r"memset", r"memcpy", r"concatenate", r"dynamic_update_slice",
                          r"(^|_)(pad|slice)(_|$)")),
    # XLA's own kernels: fusions ("loop_*", "input_*" for reductions) and single ops ("wrapped_*")
    ("elementwise / reduction", (r"fusion", r"^(loop|input|wrapped)_", r"softmax")),
)
OTHER = "other"  # a kernel no pattern matches (its name is kept in the profile summary)
GAPS = "gaps"  # GPU idle inside the timeline span (between kernels), not a kernel category
CATEGORIES = tuple(c for c, _ in KERNEL_CATEGORIES) + (OTHER,)


def kernel_category(name: str) -> str:
    """The category (:data:`CATEGORIES`) of a device kernel, from its name (:data:`KERNEL_CATEGORIES`)."""
    import re

    low = name.lower()
    for category, patterns in KERNEL_CATEGORIES:
        if any(re.search(p, low) for p in patterns):
            return category
    return OTHER


def kernel_summary(per_kernel: dict, timeline: dict | None = None, per: float = 1.0, top: int = 25,
                   label: str = "") -> dict:
    """Where the device time went, from ``device_kernel_times``' {name: seconds} (and timeline),
    both divided by ``per`` (e.g. steps per call): {"kernel_s" (sum of kernel durations),
    "n_kernels" (distinct names), "categories" {category: seconds} over :data:`CATEGORIES` plus
    :data:`GAPS` (the timeline's idle time, where given), "top" {name: seconds} (the ``top``
    largest), "unmatched" (names in "other"), "timeline" (seconds / ``per``)}. Prints the
    categories and the top kernels, prefixed by ``label``."""
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for name, sec in per_kernel.items():
        cats[kernel_category(name)] += sec / per
    tl = {k: v / per for k, v in (timeline or {}).items()}
    if "idle_s" in tl:
        cats[GAPS] = tl["idle_s"]
    ranked = sorted(((n, s / per) for n, s in per_kernel.items()), key=lambda kv: -kv[1])
    out = {"kernel_s": sum(s for _, s in ranked), "n_kernels": len(ranked), "categories": cats,
           "top": dict(ranked[:top]), "unmatched": [n for n, _ in ranked if kernel_category(n) == OTHER],
           "timeline": tl}
    print(f"    {label}kernels {out['kernel_s'] * 1e3:.3f} ms"
          + (f", GPU span {tl['span_s'] * 1e3:.3f} ms" if "span_s" in tl else "") + ": "
          + "; ".join(f"{c} {v * 1e3:.3f}" for c, v in cats.items()), flush=True)
    for name, sec in ranked[:top]:
        print(f"      {sec * 1e3:8.3f} ms  [{kernel_category(name)}] {name[:100]}", flush=True)
    return out


def kernel_time(fn, sets, *, calls: int | None = None) -> dict:
    """Device kernel time per call from the JAX profiler (one program over ``calls`` distinct
    operand sets, as in ``time_fn``): the sum of the durations of every kernel on the GPU planes
    divided by ``calls``. Returns {"kernel_s", "kernels": {name: seconds per call}, "calls",
    "timeline": see ``device_kernel_times``} or {"error": ...} where the profiler gives no device
    plane (e.g. on CPU)."""
    fn = jax.jit(fn)
    calls = calls or len(sets)
    sets = _with_distinct_calls(sets, calls)
    prog = _program(fn, calls)
    jax.block_until_ready(prog(sets))
    timeline: dict = {}
    per_kernel = device_kernel_times(lambda: jax.block_until_ready(prog(sets)), per=calls, timeline=timeline)
    if not per_kernel:
        return {"error": "no GPU kernel events in the profile"}
    return {"kernel_s": sum(per_kernel.values()), "kernels": per_kernel, "calls": calls, "timeline": timeline}


def demo_batches(cfg: dict, steps: int, data: str):
    """``i -> int32 [batch, seq_len + 1]`` token windows for step i: "random" one batch of uniform
    random bytes for every step (seed 0); "corpus" the demo's training windows
    (``load_corpus``/``batch_starts`` of examples/train_lm.py, seed 0), one batch per step."""
    import jax.numpy as jnp
    import train_lm as demo

    if data == "random":
        batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (cfg["batch"], cfg["seq_len"] + 1)), jnp.int32)
        return lambda i: batch
    if data != "corpus":
        raise ValueError(f"data must be 'random' or 'corpus', got {data!r}")
    train_b, _, _ = demo.load_corpus()
    starts = demo.batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], max(steps, 1), 0)
    return lambda i: jnp.asarray(demo.windows(train_b, starts[i % len(starts)], cfg["seq_len"]))


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else float("nan")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))


def out_dir(path):
    """Make the output folder ``path`` (if missing) and return it; SystemExit with the reason where
    it cannot be one (a file in the way, no permission). Scripts call it before their work, so a
    bad ``--out`` costs no run."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --out must name a folder (made if missing), got {path!r}: {e}") from None
    return path


def write_report(out, name, result, markdown, figure) -> int:
    """Write ``{name}.json`` and ``{name}.md`` (``markdown(result)``) into ``out``, the figure if
    matplotlib is there, print the table; the exit status: 0 when every row's status is "ok"."""
    write_json(os.path.join(out, f"{name}.json"), result)
    md = markdown(result)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    try:
        figure(result, out)
    except ImportError as e:  # matplotlib is optional (the "bench" extra)
        print(f"no figure: {e}")
    print("\n" + md)
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


def save_figure(fig, out, name):
    """Tight layout, save ``name`` (PNG, 120 dpi) into ``out``, close; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
