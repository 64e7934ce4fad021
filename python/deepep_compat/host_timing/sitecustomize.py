"""`run.py --host-timing`: the host time of every Buffer call inside the test's own process.

Put first on PYTHONPATH, this module is imported at interpreter start. When `deep_ep` is
imported (DeepEP's build, or the shim that resolves it to ep_dispatch), `Buffer`'s
`low_latency_dispatch` and `low_latency_combine` are wrapped: `time.perf_counter` around each
call, and around the receive hook it returns (`return_recv_hook=True`). At exit each process
prints one line per (method, hooks) pair and one per hook kind:

    [host-timing] rank R low_latency_dispatch hooks=False: calls N, median M us, min m us

The wrapper is the same Python frame for both implementations (about 1 us a call, and one
closure a hooked call), so the two figures compare; it measures what the test's process spends
on the host, where bench.py's host enqueue measures calls queued behind a long sleep kernel.
"""

import atexit
import importlib.abc
import importlib.util
import os
import sys
import time

_TIMES = {}
_METHODS = ("low_latency_dispatch", "low_latency_combine")
_RANK = []  # the process group's rank, read at the first call (the test's processes are spawned)


def _rank():
    if not _RANK:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
        except ImportError:
            pass
        _RANK.append(f"{rank}" if rank is not None else f"pid{os.getpid()}")
    return _RANK[0]


def _record(key, dt):
    _TIMES.setdefault(key, []).append(dt)


def _timed_hook(hook, key):
    def run_hook(*a, **k):
        t0 = time.perf_counter()
        try:
            return hook(*a, **k)
        finally:
            _record(key, time.perf_counter() - t0)

    return run_hook


def _wrap(name, fn):
    def timed(*a, **k):
        hooks = bool(k.get("return_recv_hook", False))
        _rank()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        _record((name, hooks), time.perf_counter() - t0)
        # The hook is the last element of the returned tuple (DeepEP's signature).
        if hooks and isinstance(out, tuple) and out and callable(out[-1]):
            out = out[:-1] + (_timed_hook(out[-1], (name + " hook", True)),)
        return out

    timed.__wrapped__ = fn
    timed.__name__ = name
    return timed


def _patch(module):
    buf = getattr(module, "Buffer", None)
    if buf is None or getattr(buf, "_host_timing", False):
        return
    for name in _METHODS:
        fn = getattr(buf, name, None)
        if fn is not None:
            setattr(buf, name, _wrap(name, fn))
    buf._host_timing = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `deep_ep` through the other finders and patches it once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "deep_ep":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def _report():
    if not _TIMES:
        return
    rank = _rank()
    for (name, hooks), v in sorted(_TIMES.items()):
        v = sorted(v)
        print(f"[host-timing] rank {rank} {name} hooks={hooks}: calls {len(v)}, "
              f"median {v[len(v) // 2] * 1e6:.2f} us, min {v[0] * 1e6:.2f} us", flush=True)


def _chain():
    """Runs the sitecustomize this one shadows (the next on sys.path), if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        f = os.path.join(d or ".", "sitecustomize.py")
        if os.path.abspath(d or ".") != here and os.path.isfile(f):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", f)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


sys.meta_path.insert(0, _Finder())
atexit.register(_report)
_chain()
