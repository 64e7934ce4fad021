"""Low-latency dispatch/combine benchmark, measured as DeepEP's test_low_latency.py measures it:
kernel times from torch.profiler, bandwidth = selections x bytes per message / mean kernel time.

    torchrun --nproc-per-node N python/bench.py [--impl ep_dispatch|deep_ep|both] \\
        [--tokens 128 --hidden 7168 --topk 8 --experts 288] [--path batched|per_expert]

Prints, per rank and implementation, DeepEP's lines:

    [rank r] Dispatch bandwidth: ... GB/s, avg_t=... us | Combine bandwidth: ... GB/s, avg_t=... us
    [rank r] Dispatch send/recv time: ... + ... us | Combine send/recv time: ... + ... us

and what an engine sees of one dispatch+combine pair (median over --pairs pairs each):

    [rank r] Host enqueue per pair: ... us (hooks: ... us) | Event time per eager pair: ... us |
             Graph replay per pair: ... us

host enqueue: ``time.perf_counter`` around the two calls (and their hooks), no synchronisation,
on a stream kept busy ahead of them so that launches never wait for the GPU; event time: CUDA
events around each eager pair, one pair at a time; graph replay: one pair captured in a CUDA
graph, replayed back to back, CUDA events around the replays.

``deep_ep`` is imported only if installed (never vendored); ``--impl both`` times the two side by
side on the same inputs. Message bytes as DeepEP counts them: FP8 dispatch ``H + H/128*4 + 16``,
BF16 combine ``2H``, per selection (``topk_idx != -1``).
"""

import argparse
import datetime
import importlib
import os
import socket
import sys


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["ep_dispatch", "deep_ep", "both"], default="ep_dispatch")
    p.add_argument("--tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288, help="all experts (a multiple of N)")
    p.add_argument("--path", choices=["batched", "per_expert"], default="batched",
                   help="ep_dispatch's path")
    p.add_argument("--no-fp8", action="store_true", help="BF16 dispatch")
    p.add_argument("--iters", type=int, default=30, help="profiled periods")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--masked", type=int, default=10, help="top-k slots set to -1 at random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", type=int, default=300,
                   help="pairs for the host enqueue, event and graph replay figures (0: none)")
    p.add_argument("--host-profile", type=int, default=0, metavar="PAIRS",
                   help="after the figures, cProfile PAIRS eager pairs (stream kept busy) and "
                        "print the functions that took the host's time")
    return p.parse_args()


def init(torch):
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=300)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timeout)
    return dist


def kernel_times(prof, names, per_period):
    """Mean kernel duration (s) per name substring; with `per_period` = 2 (the hook split) the
    launches alternate send, recv and each half gets its own mean."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    out = []
    for name in names:
        d = [e.time_range.elapsed_us() * 1e-6 for e in kernels if name in e.name]
        if not d or len(d) % per_period:
            raise RuntimeError(f"profiler saw {len(d)} '{name}' kernels, expected a multiple of "
                               f"{per_period} (kernel names: {sorted({e.name for e in kernels})})")
        out.append(tuple(sum(d[i::per_period]) / (len(d) // per_period)
                         for i in range(per_period)))
    return out


def bench(torch, dist, fn, iters, warmup, per_period):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            # Align the ranks before each period, so no rank's wait for a late peer counts.
            torch.cuda.synchronize()
            dist.barrier()
            fn()
        torch.cuda.synchronize()
    return kernel_times(prof, ("dispatch", "combine"), per_period)


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def engine_view(torch, dist, step, pairs):
    """(host enqueue us, with hooks us, event time per eager pair us, graph replay per pair
    us): what an engine calling the Buffer sees, beside the kernels' own time."""
    import time

    eager, hooked = step(False), step(True)
    stream = torch.cuda.current_stream()
    # Host time: the stream is kept busy (a long sleep kernel ahead of every batch of calls),
    # so no launch waits for the GPU and the figure is the host's own.
    host = {}
    for name, fn in (("eager", eager), ("hooks", hooked)):
        times = []
        for chunk in range(0, pairs, 50):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda._sleep(int(2e8))  # ~0.1 s of cycles ahead of the calls
            for _ in range(min(50, pairs - chunk)):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        host[name] = median(times)
    # Event time of one eager pair at a time.
    ev = []
    for _ in range(pairs):
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        eager()
        b.record(stream)
        b.synchronize()
        ev.append(a.elapsed_time(b) * 1e3)
    # Graph replay: one pair captured (after the eager calls above formed every group).
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    for _ in range(pairs):
        graph.replay()
    b.record(stream)
    b.synchronize()
    return host["eager"], host["hooks"], median(ev), a.elapsed_time(b) * 1e3 / pairs


def host_profile(torch, fn, pairs, rank):
    """Where the host's time per eager pair goes: cProfile over `pairs` pairs enqueued behind a
    long sleep kernel (no launch waits for the GPU); the top functions by own time, per pair.
    (cProfile's own overhead inflates Python-level frames; native and torch calls less.)"""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(pairs):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:22]
    total = sum(v[2] for v in st.stats.values())
    print(f"[rank {rank}] host profile: {total / pairs * 1e6:.1f} us per pair in profiled "
          f"frames (own time); top functions, us per pair (calls per pair):", flush=True)
    for (file, line, func), (cc, nc, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"[rank {rank}]   {tt / pairs * 1e6:7.2f}  ({nc / pairs:4.1f})  {func}  [{where}]",
              flush=True)


def run(torch, dist, module, a, x, topk_idx, topk_weights, rank, R):
    T, H, E = a.tokens, a.hidden, a.experts
    use_fp8 = not a.no_fp8
    hint = module.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    kw = dict(path=a.path) if module.__name__ == "ep_dispatch" else {}
    buf = module.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True,
                        num_qps_per_rank=E // R, **kw)
    if rank == 0 and hasattr(buf, "call_path"):  # ours: the C++ extension or the Python path
        print(f"== {module.__name__} call path: {buf.call_path}", flush=True)
    y = torch.randn(E // R, R * T, H, device="cuda").to(torch.bfloat16)

    def step(return_recv_hook):
        def f():
            _, _, handle, _, hook = buf.low_latency_dispatch(
                x, topk_idx, T, E, use_fp8=use_fp8, return_recv_hook=return_recv_hook)
            if hook is not None:
                hook()
            _, _, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle,
                                                 return_recv_hook=return_recv_hook)
            if hook is not None:
                hook()
        return f

    sel = int((topk_idx != -1).sum().item())
    d_bytes = sel * ((H + H // 128 * 4 + 16) if use_fp8 else 2 * H)
    c_bytes = sel * 2 * H
    (dt,), (ct,) = bench(torch, dist, step(False), a.iters, a.warmup, 1)
    print(f"[rank {rank}] Dispatch bandwidth: {d_bytes / 1e9 / dt:.2f} GB/s, "
          f"avg_t={dt * 1e6:.2f} us | Combine bandwidth: {c_bytes / 1e9 / ct:.2f} GB/s, "
          f"avg_t={ct * 1e6:.2f} us", flush=True)
    (ds, dr), (cs, cr) = bench(torch, dist, step(True), a.iters, a.warmup, 2)
    print(f"[rank {rank}] Dispatch send/recv time: {ds * 1e6:.2f} + {dr * 1e6:.2f} us | "
          f"Combine send/recv time: {cs * 1e6:.2f} + {cr * 1e6:.2f} us", flush=True)
    if a.pairs > 0:
        host, host_hook, event, replay = engine_view(torch, dist, step, a.pairs)
        print(f"[rank {rank}] Host enqueue per pair: {host:.2f} us (hooks: {host_hook:.2f} us) | "
              f"Event time per eager pair: {event:.2f} us | Graph replay per pair: "
              f"{replay:.2f} us", flush=True)
    if a.host_profile > 0:
        host_profile(torch, step(False), a.host_profile, rank)
    if hasattr(buf, "check"):
        buf.check()  # ours: raise anything the kernels recorded (timeouts, bad routing)
    if hasattr(buf, "destroy") and getattr(buf, "explicitly_destroy", True):
        buf.destroy()


def main():
    a = parse()
    import torch

    dist = init(torch)
    rank, R = dist.get_rank(), dist.get_world_size()
    if a.experts % R:
        sys.exit(f"--experts {a.experts} is not a multiple of the {R} ranks")
    g = torch.Generator(device="cuda").manual_seed(a.seed + rank)
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.randn(T, E, device="cuda", generator=g).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False).indices.to(torch.int64)
    pick = torch.Generator().manual_seed(a.seed * 7919 + rank)
    for _ in range(a.masked):
        t = int(torch.randint(0, T, (1,), generator=pick))
        k = int(torch.randint(0, K, (1,), generator=pick))
        topk_idx[t, k] = -1
    topk_weights = torch.randn(T, K, device="cuda", generator=g).abs()

    impls = ["ep_dispatch", "deep_ep"] if a.impl == "both" else [a.impl]
    for name in impls:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if rank == 0:
                print(f"== {name}: not installed ({e}); skipped", flush=True)
            continue
        if rank == 0:
            extra = f" path={a.path}" if name == "ep_dispatch" else ""
            print(f"== {name}.Buffer: R={R} T={T} H={H} K={K} E={E} "
                  f"{'bf16' if a.no_fp8 else 'fp8'} dispatch{extra}", flush=True)
        dist.barrier()
        run(torch, dist, module, a, x, topk_idx, topk_weights, rank, R)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
