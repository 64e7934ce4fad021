"""What the Buffer's Python layer costs per eager dispatch + combine pair, measured on the CPU:
the native GPU rank is replaced by a stand-in that enqueues nothing (its calls return at once,
after the native tensor checks), so only our plumbing is timed. Both call paths:

- ``python`` (``Buffer.call_path == 'python'``): outputs by ``torch.empty``, the native checks
  reading each tensor's metadata through its Python attributes; the stand-in is a Python class
  over ``CallSpec``'s checks (``NullRank``);
- ``extension``: the C++ torch extension allocates the outputs (``at::empty``) and describes the
  tensors; the stand-in is the native ``_StandInRank``, whose C ABI entry runs the same checks on
  the descriptors and counts ids instead of enqueueing (a no-op Rust entry behind the real
  descriptor parsing and checks). Its receive halves (the hooks: the extension's native
  ``RecvHook``) go through the C ABI's ``recv`` entry to the stand-in's native receive half,
  which frees the send half's tensors as the GPU rank does.

    python python/call_costs.py [--pairs 2000] [--live 167000] [--path both] [--json]

Prints, per path, for pairs without and with receive hooks (DeepEP's test passes the cumulative
stats):

- torch calls: Python-level torch calls per pair that a ``TorchFunctionMode`` sees (what
  ``torch.set_default_device('cuda')`` routes through ``torch.utils._device.__torch_function__``),
  by name, and all the calls made (with the Buffer's disabling of torch functions turned off);
- objects: GC-tracked objects the pair leaves alive while its results are held (the handle,
  hooks, tensors: what the collector's generation 0 counts; "left after" is that count once
  they are dropped, which CPython's free lists keep from falling all the way back);
- host time per pair (median; the release of its outputs included): plain, under the
  default-device mode, and under that mode in a process holding ``--live`` other objects with
  the collector on (DeepEP's test holds about 167,000). torch's CPU allocator takes large
  outputs from ``malloc``, whose mmap threshold moves at run time; for steady figures run with
  ``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736`` (on a GPU, torch's
  caching allocator serves them).

Needs torch (a CPU build is enough), the built wheel (run it from outside python/, or with
``python -P``, so that ``import ep_dispatch`` is the installed one) and, for the extension path,
a C++ compiler and ninja (it is built at the first Buffer, as on a GPU machine). One Buffer of a
2-rank group in one process, the native rank replaced as above; T=128, H=7168, K=8, E=16, FP8
dispatch.
"""

import argparse
import gc
import json
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

import ep_dispatch as ep
from ep_dispatch import _ep_dispatch as native

T, H, K, R, E = 128, 7168, 8, 2, 16


class NullRank:
    """The native rank's API enqueueing nothing: each call makes the native tensor checks (the
    real ones, `CallSpec`) and returns ids as the native rank does."""

    def __init__(self, spec, *args, **kwargs):
        self.spec = spec
        self.next_id = self.next_c = 1
        self.pending = self.pending_c = None

    def poll(self):
        pass

    def check(self):
        pass

    def dispatch(self, stream, *tensors):
        self.spec.check_dispatch(*tensors)
        self.pending = None
        self.next_id += 1
        return self.next_id - 1

    def dispatch_send(self, stream, *tensors):
        self.pending = self.dispatch(stream, *tensors)
        return self.pending

    def dispatch_recv(self, stream, hid):
        done, self.pending = self.pending == hid, None
        return done

    def combine(self, stream, handle, x, topk_idx, topk_weights, out, wait_stats=None,
                use_logfmt=False):
        self.spec.check_combine(T, x, topk_idx, topk_weights, out, wait_stats, use_logfmt)
        self.pending_c = None
        self.next_c += 1
        return self.next_c - 1

    def combine_send(self, stream, handle, x, topk_idx, topk_weights, out, wait_stats=None,
                     keep=None, use_logfmt=False):
        self.pending_c = self.combine(stream, handle, x, topk_idx, topk_weights, out,
                                      wait_stats, use_logfmt)
        return self.pending_c

    def combine_recv(self, stream, cid):
        done, self.pending_c = self.pending_c == cid, None
        return done


class NullTarget:
    """What the Buffer calls on a native `_StandInRank` besides its C ABI entries, enqueueing
    nothing."""

    def poll(self):
        pass

    def check(self):
        pass


class Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def make_buffer(path, ins):
    """A Buffer on the host whose ranks are the stand-ins of `path` (its group formed by a first
    pair, while `GpuRank` is that path's stand-in); None where the extension is not available."""
    native.probe_devices = lambda n: 1
    native.probe_transport = lambda t: None
    if path == "extension":
        native.GpuRank = lambda spec, *a, **k: native._StandInRank(spec, NullTarget())
    else:
        native.GpuRank = NullRank
    torch.cuda.current_device = lambda: 0
    b = ep.Buffer(Group(0, R), 0, 1 << 20, True, E // R)
    if path == "python":
        b._ext = None
    elif b._ext is None:
        return None
    b._dev = torch.device("cpu")
    b._dev_index = -1
    b._stream = lambda: 0
    pair(b, ins, False)
    return b


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int64).contiguous()
    w = torch.rand(T, K, generator=g)
    y = torch.zeros(E // R, R * T, H, dtype=torch.bfloat16)
    stats = torch.zeros(E // R, dtype=torch.int32)
    return x, topk, w, y, stats


def pair(b, ins, hooks):
    x, topk, w, y, stats = ins
    recv_x, count, handle, _, hook = b.low_latency_dispatch(
        x, topk, T, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=hooks)
    if hooks:
        hook()
    out, _, chook = b.low_latency_combine(y, topk, w, handle, return_recv_hook=hooks)
    if hooks:
        chook()
    return recv_x, count, handle, out


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", "property")
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def torch_calls(b, ins, hooks, n=10):
    pair(b, ins, hooks)
    with Count() as c:
        for _ in range(n):
            pair(b, ins, hooks)
    return {k: v / n for k, v in sorted(c.names.items())}


def all_torch_calls(b, ins, hooks):
    """Every Python-level torch call a pair makes, ours and the native side's metadata reads
    included: counted with the Buffer's disabling of torch functions turned off."""
    notf = b._notf
    b._notf = _Open
    try:
        return torch_calls(b, ins, hooks)
    finally:
        b._notf = notf


class _Open:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def objects(b, ins, hooks, n=50):
    pair(b, ins, hooks)
    gc.collect()
    gc.disable()
    try:
        c0 = gc.get_count()[0]
        held = [pair(b, ins, hooks) for _ in range(n)]
        alive = (gc.get_count()[0] - c0) / n
        del held
        left = (gc.get_count()[0] - c0) / n
    finally:
        gc.enable()
    return alive, left


def host_us(bs, ins, hooks, pairs):
    """The median host time per pair of each Buffer of `bs`, the Buffers taking turns pair by
    pair (so a slow spell of a shared machine hits each alike)."""
    for b in bs:
        for _ in range(50):
            pair(b, ins, hooks)
    t = [[] for _ in bs]
    for _ in range(pairs):
        for i, b in enumerate(bs):
            # The release of the pair's outputs counts too: on the extension path the stand-in
            # holds a send half's tensors as the GPU rank does, and frees them inside the next
            # call.
            t0 = time.perf_counter()
            r = pair(b, ins, hooks)
            del r
            t[i].append(time.perf_counter() - t0)
    return [sorted(x)[len(x) // 2] * 1e6 for x in t]


def measure(bs, ins, pairs, live):
    """Per path (`bs`: path -> Buffer) and hooks or not: the torch calls, objects and host
    times of a pair."""
    res = {path: {} for path in bs}
    paths, bufs = list(bs), list(bs.values())
    for hooks in (False, True):
        k = "hooks" if hooks else "plain"
        for path, b in bs.items():
            r = res[path][k] = {}
            r["torch_calls"] = torch_calls(b, ins, hooks)
            r["torch_calls_total"] = sum(r["torch_calls"].values())
            r["all_torch_calls"] = all_torch_calls(b, ins, hooks)
            r["all_torch_calls_total"] = sum(r["all_torch_calls"].values())
            r["objects_alive"], r["objects_left"] = objects(b, ins, hooks)

        def put(name, values):
            for path, v in zip(paths, values):
                res[path][k][name] = v

        put("host_us", host_us(bufs, ins, hooks, pairs))
        torch.set_default_device("cpu")
        try:
            put("host_us_default_device", host_us(bufs, ins, hooks, pairs))
            held = [{} for _ in range(live)]
            collections = []
            gc.callbacks.append(lambda phase, info: collections.append(1)
                                if phase == "start" else None)
            put("host_us_default_device_live", host_us(bufs, ins, hooks, pairs))
            n = len(collections) * 1000 / ((pairs + 50) * len(bufs))
            put("collections_per_1000_pairs", [n] * len(bufs))
            gc.callbacks.pop()
            del held
        finally:
            torch.set_default_device(None)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--live", type=int, default=167_000)
    p.add_argument("--path", choices=["python", "extension", "both"], default="both")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    ins = inputs()
    bs, missing = {}, {}
    for path in (["python", "extension"] if a.path == "both" else [a.path]):
        b = make_buffer(path, ins)
        if b is None:
            from ep_dispatch import _torch_ext

            why = _torch_ext._loaded.get(str(_torch_ext.SOURCE), (None, "EP_DISPATCH_TORCH_EXT=0"))
            missing[path] = {"unavailable": why[1]}
        else:
            bs[path] = b
    res = measure(bs, ins, a.pairs, a.live)
    res.update(missing)
    if a.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return
    for path, pr in res.items():
        if "unavailable" in pr:
            print(f"[{path}] not measured: the extension is not available ({pr['unavailable']})")
            continue
        for k, r in pr.items():
            t = f"[{path} {k}]"
            print(f"{t} torch calls per pair: {r['torch_calls_total']:g} "
                  f"({', '.join(f'{n} {v:g}' for n, v in r['torch_calls'].items())})")
            print(f"{t} torch calls made per pair (the Buffer's and the native side's, "
                  f"modes off or not): {r['all_torch_calls_total']:g} "
                  f"({', '.join(f'{n} {v:g}' for n, v in r['all_torch_calls'].items())})")
            print(f"{t} GC-tracked objects per pair: {r['objects_alive']:g} alive while held, "
                  f"{r['objects_left']:g} left after")
            print(f"{t} host per pair: {r['host_us']:.1f} us | default device: "
                  f"{r['host_us_default_device']:.1f} us | + {a.live} live objects: "
                  f"{r['host_us_default_device_live']:.1f} us "
                  f"({r['collections_per_1000_pairs']:.1f} collections per 1000 pairs)")


if __name__ == "__main__":
    main()
