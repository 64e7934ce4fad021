"""Runs DeepEP's own low-latency test, unmodified, on ep_dispatch (and on DeepEP beside it).

    python python/deepep_compat/run.py DEEPEP_CHECKOUT [--impl ours|deepep|both] [--log-dir D]
                                       [--host-timing] [-- test_low_latency.py's arguments]

DEEPEP_CHECKOUT is a DeepEP source tree (v1, e.g. commit 567632d); nothing of it is copied here.
`--impl ours` runs DEEPEP_CHECKOUT/tests/test_low_latency.py with `import deep_ep` resolved to
ep_dispatch (the shim package beside this script, first on PYTHONPATH); `--impl deepep` runs it
on DeepEP's own build (`python setup.py build_ext --inplace` in the checkout); `both` runs one
after the other and prints the lines the test prints per rank (the round trip by CUDA events,
the kernel times and the hook split from the profiler) side by side. `--host-timing` also times, inside the test's own processes, the host
time of every `low_latency_dispatch` / `low_latency_combine` call and of each receive hook
(host_timing/sitecustomize.py, the same wrapper for both implementations) and adds their
medians to the table. Exit status: 0 when every run exited 0.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The per-rank lines test_low_latency.py prints after its correctness loop (DeepEP v1).
FIGURES = [
    ("dispatch+combine avg_t (events)", r"Dispatch \+ combine bandwidth: .*?avg_t=([\d.]+) us"),
    ("dispatch kernel (profiler)", r"Dispatch bandwidth: .*?avg_t=([\d.]+) us \|"),
    ("combine kernel (profiler)", r"Combine bandwidth: .*?avg_t=([\d.]+) us"),
    ("dispatch send (hook)", r"Dispatch send/recv time: ([\d.]+) \+"),
    ("dispatch recv (hook)", r"Dispatch send/recv time: [\d.]+ \+ ([\d.]+) us"),
    ("combine send (hook)", r"Combine send/recv time: ([\d.]+) \+"),
    ("combine recv (hook)", r"Combine send/recv time: [\d.]+ \+ ([\d.]+) us"),
]


# `--host-timing`'s lines (host_timing/sitecustomize.py): per rank, method and hooks flag.
HOST = r"\[host-timing\] rank \S+ (.+?) hooks=(\w+): calls \d+, median ([\d.]+) us"


def env_for(impl, checkout, host_timing=False):
    env = dict(os.environ)
    first = str(HERE) if impl == "ours" else str(checkout)
    timing = str(HERE / "host_timing") if host_timing else ""
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (timing, first, str(checkout / "tests"), env.get("PYTHONPATH", "")) if p)
    return env


def resolved(impl, checkout):
    """Where `import deep_ep` leads under impl's PYTHONPATH (checked before the test runs)."""
    out = subprocess.run([sys.executable, "-c", "import deep_ep; print(deep_ep.__file__)"],
                         env=env_for(impl, checkout), capture_output=True, text=True,
                         cwd=checkout / "tests")
    if out.returncode != 0:
        raise SystemExit(f"run.py: `import deep_ep` fails for --impl {impl}:\n{out.stderr}")
    return out.stdout.strip()


def run(impl, checkout, test_args, log_dir, host_timing=False):
    where = resolved(impl, checkout)
    want = str(HERE) if impl == "ours" else str(checkout)
    if not where.startswith(want):
        raise SystemExit(f"run.py: --impl {impl}: deep_ep resolves to {where}, not under {want}")
    cmd = [sys.executable, "test_low_latency.py", *test_args]
    print(f"== {impl}: deep_ep is {where}\n== {' '.join(cmd)} (in {checkout / 'tests'})",
          flush=True)
    log = log_dir / f"test_low_latency-{impl}.log" if log_dir else None
    lines = []
    with subprocess.Popen(cmd, cwd=checkout / "tests", env=env_for(impl, checkout, host_timing),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            sys.stdout.write(f"[{impl}] {line}")
            lines.append(line)
    if log:
        log.write_text("".join(lines))
    print(f"== {impl}: exit {p.returncode}", flush=True)
    return p.returncode, lines


def figures(lines):
    """Per figure, the mean over ranks of what each rank printed (us), or None."""
    out = {}
    for name, pat in FIGURES:
        vals = [float(m.group(1)) for line in lines if (m := re.search(pat, line))]
        out[name] = sum(vals) / len(vals) if vals else None
    host = {}
    for line in lines:
        if m := re.search(HOST, line):
            host.setdefault(f"host: {m.group(1)}{' (hooks)' if m.group(2) == 'True' else ''}",
                            []).append(float(m.group(3)))
    out.update({name: sum(v) / len(v) for name, v in sorted(host.items())})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a DeepEP source tree (v1)")
    ap.add_argument("--impl", choices=["ours", "deepep", "both"], default="ours")
    ap.add_argument("--log-dir", type=Path, help="write each run's whole output here")
    ap.add_argument("--host-timing", action="store_true",
                    help="also time each Buffer call's host time inside the test's processes")
    argv = list(sys.argv[1:] if argv is None else argv)
    test_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.test_args = test_args
    checkout = a.checkout.resolve()
    if not (checkout / "tests" / "test_low_latency.py").is_file():
        ap.error(f"argument checkout: {checkout}/tests/test_low_latency.py not found")
    if a.log_dir:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    impls = ["ours", "deepep"] if a.impl == "both" else [a.impl]
    results = {impl: run(impl, checkout, a.test_args, a.log_dir, a.host_timing) for impl in impls}
    table = {impl: figures(lines) for impl, (_, lines) in results.items()}
    print(f"\n== test_low_latency.py {' '.join(a.test_args)}: mean over ranks, us")
    print(f"{'':34}" + "".join(f"{impl:>12}" for impl in impls))
    extra = {n for t in table.values() for n in t} - {n for n, _ in FIGURES}
    names = [n for n, _ in FIGURES] + sorted(extra)
    for name in names:
        cells = [table[i].get(name) for i in impls]
        print(f"{name:34}" + "".join(f"{'-' if c is None else f'{c:.2f}':>12}" for c in cells))
    for impl, (rc, _) in results.items():
        print(f"{impl}: exit {rc}")
    return 0 if all(rc == 0 for rc, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
