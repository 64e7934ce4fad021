"""What the Buffer's Python layer costs per eager dispatch + combine pair, measured on the CPU:
the native GPU rank is replaced by a stand-in that enqueues nothing (its calls return at once,
after the native tensor checks where the native API has them), so only our plumbing is timed.

    python python/call_costs.py [--pairs 2000] [--live 167000] [--json]

Prints, for pairs without and with receive hooks (DeepEP's test passes the cumulative stats):

- torch calls: Python-level torch calls per pair that a ``TorchFunctionMode`` sees (what
  ``torch.set_default_device('cuda')`` routes through ``torch.utils._device.__torch_function__``),
  by name;
- objects: GC-tracked objects the pair leaves alive while its results are held (the handle,
  hooks, tensors: what the collector's generation 0 counts; "left after" is that count once
  they are dropped, which CPython's free lists keep from falling all the way back);
- host time per pair: plain, under the default-device mode, and under that mode in a process
  holding ``--live`` other objects with the collector on (DeepEP's test holds about 167,000).

Needs torch (a CPU build is enough) and the built wheel (run it from outside python/, or with
``python -P``, so that ``import ep_dispatch`` is the installed one). One Buffer of a 2-rank group
in one process, the native rank replaced as above; T=128, H=7168, K=8, E=16, FP8 dispatch.
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


class Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def make_buffer():
    native.probe_devices = lambda n: 1
    native.probe_transport = lambda t: None
    native.GpuRank = NullRank
    torch.cuda.current_device = lambda: 0
    b = ep.Buffer(Group(0, R), 0, 1 << 20, True, E // R)
    b._dev = torch.device("cpu")
    b._dev_index = -1
    b._stream = lambda: 0
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


def host_us(b, ins, hooks, pairs):
    for _ in range(50):
        pair(b, ins, hooks)
    t = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        r = pair(b, ins, hooks)
        t.append(time.perf_counter() - t0)
        del r
    t.sort()
    return t[len(t) // 2] * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--live", type=int, default=167_000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    b, ins = make_buffer(), inputs()
    res = {}
    for hooks in (False, True):
        k = "hooks" if hooks else "plain"
        r = res[k] = {}
        r["torch_calls"] = torch_calls(b, ins, hooks)
        r["torch_calls_total"] = sum(r["torch_calls"].values())
        if hasattr(b, "_notf"):
            r["all_torch_calls"] = all_torch_calls(b, ins, hooks)
            r["all_torch_calls_total"] = sum(r["all_torch_calls"].values())
        r["objects_alive"], r["objects_left"] = objects(b, ins, hooks)
        r["host_us"] = host_us(b, ins, hooks, a.pairs)
        torch.set_default_device("cpu")
        try:
            r["host_us_default_device"] = host_us(b, ins, hooks, a.pairs)
            live = [{} for _ in range(a.live)]
            collections = []
            gc.callbacks.append(lambda phase, info: collections.append(1)
                                if phase == "start" else None)
            r["host_us_default_device_live"] = host_us(b, ins, hooks, a.pairs)
            r["collections_per_1000_pairs"] = len(collections) * 1000 / (a.pairs + 50)
            gc.callbacks.pop()
            del live
        finally:
            torch.set_default_device(None)
    if a.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return
    for k, r in res.items():
        print(f"[{k}] torch calls per pair: {r['torch_calls_total']:g} "
              f"({', '.join(f'{n} {v:g}' for n, v in r['torch_calls'].items())})")
        if "all_torch_calls" in r:
            print(f"[{k}] torch calls made per pair (the Buffer's and the native side's, "
                  f"modes off or not): {r['all_torch_calls_total']:g} "
                  f"({', '.join(f'{n} {v:g}' for n, v in r['all_torch_calls'].items())})")
        print(f"[{k}] GC-tracked objects per pair: {r['objects_alive']:g} alive while held, "
              f"{r['objects_left']:g} left after")
        print(f"[{k}] host per pair: {r['host_us']:.1f} us | default device: "
              f"{r['host_us_default_device']:.1f} us | + {a.live} live objects: "
              f"{r['host_us_default_device_live']:.1f} us "
              f"({r['collections_per_1000_pairs']:.1f} collections per 1000 pairs)")


if __name__ == "__main__":
    main()
