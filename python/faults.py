"""Fault trials of the Python Buffer (issue 20 item 5), on a GPU machine with torch.

    python faults.py [--trials N] [--timeout-s S] [--shrink] [--kinds kill,stall] [--seed N]

Each trial starts two ranks (this file with ``--rank``; their own gloo rendezvous on a free
port, not torchrun, which would end the survivor when its peer dies), both on GPU 0 unless there
are two. Each builds a ``Buffer(timeout_s=S)`` (``enable_shrink=True`` with ``--shrink``), says
READY, and makes the same CALLS dispatch+combine pairs with fresh inputs from a shared seed,
checking its outputs against the oracle after every pair. At a random moment of those calls the
driver stops one rank, chosen at random: SIGKILL (``kill``) or SIGSTOP (``stall``).

- Without ``--shrink`` the survivor must raise (an ``ep_dispatch`` error naming the lost rank),
  within the wait bound + 1 s of the fault. Until then every pair it checked must be equal to
  the oracle: a failed call is never taken for a good one.
- With ``--shrink`` the survivor must finish all its calls, each pair equal to the oracle on the
  routing the rank mask leaves (the mask read after the dispatch and after the combine), with the
  lost rank in its mask at the end.

Prints one line per trial and a summary table; exits 0 when every trial passed.
"""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
import types

T, H, K, E_PER_RANK = 16, 512, 4, 4
CALLS = 1500


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank ---------------------------------------------------------------------------------

def rank_main(a):
    import datetime

    import torch
    import torch.distributed as dist

    import ep_dispatch as ep
    from ep_dispatch import oracle

    R, rank = 2, a.rank
    E, L = E_PER_RANK * R, E_PER_RANK
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=R, timeout=datetime.timedelta(seconds=60))
    b = ep.Buffer(dist.group.WORLD, timeout_s=a.timeout_s, enable_shrink=a.shrink)
    g = torch.Generator().manual_seed(a.seed)

    def inputs():
        out = []
        for _ in range(R):
            x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
            topk = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int64)
            topk[torch.rand(T, K, generator=g) < 0.1] = -1
            w = torch.randn(T, K, generator=g)
            y = torch.randn(L, R * T, H, generator=g).to(torch.bfloat16)
            out.append((x, topk, w, y))
        return out

    def masked(ins, m):
        routing = oracle.masked_routing([i[1] for i in ins], E, {d for d in range(R) if m[d]})
        return [(x, t, w, y) for (x, _, w, y), t in zip(ins, routing)]

    mask = torch.zeros(R, dtype=torch.int32, device=dev)
    # Warm up (forms the group, compiles), then READY.
    ins = inputs()
    x, topk, w, y = (t.to(dev) for t in ins[rank])
    _, _, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    b.low_latency_combine(y, topk, w, h)
    torch.cuda.synchronize()
    print("READY", flush=True)
    checked = 0
    t0 = time.monotonic()
    try:
        for call in range(CALLS):
            ins = inputs()
            x, topk, w, y = (t.to(dev) for t in ins[rank])
            rx, cnt, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
            if a.shrink:
                b.low_latency_query_mask_buffer(mask)
                md = mask.tolist()
            out, _, _ = b.low_latency_combine(y, topk, w, h)
            if a.shrink:
                b.low_latency_query_mask_buffer(mask)
                mc = mask.tolist()
            torch.cuda.synchronize()
            # An engine learns of a failed call at its next call; this harness looks between
            # calls (no synchronisation needed: poll reads host memory the kernels write), so
            # that a failed call's outputs (defined: no rows, NaN) are never checked as a good
            # call's.
            b.poll()
            if a.shrink:
                eff = masked(ins, md)
                want = oracle.dispatch([i[0] for i in eff], [i[1] for i in eff], T, E,
                                       use_fp8=False)
                # Rows where this call's dispatch put them; the slots of ranks masked since
                # drop out (a zero weight drops a slot bit for bit).
                ws = []
                for r, (_, t, wt, _) in enumerate(eff):
                    wz = wt.clone()
                    for d in range(R):
                        if mc[d] and not md[d]:
                            wz[(t >= 0) & (t // L == d)] = 0.0
                    ws.append(wz)
                want_c = oracle.combine([i[3] for i in eff], [i[1] for i in eff], ws, T, E)
            else:
                want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E,
                                       use_fp8=False)
                want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins],
                                        [i[2] for i in ins], T, E)
            got = types.SimpleNamespace(recv_x=rx, recv_x_scales=None, recv_count=cnt,
                                        layout_range=h.layout_range, src_info=h.src_info)
            d1 = oracle.diff(got, want[rank])
            d2 = oracle.combine_diff(out, want_c[rank])
            if d1 is not None or d2 is not None:
                print(f"WRONG call {call}: dispatch {d1}; combine {d2}", flush=True)
                return 3
            checked += 1
    except ep.EpError as e:
        print(f"RAISED {type(e).__name__} after {checked} good pairs, "
              f"{time.monotonic() - t0:.3f} s: {e}", flush=True)
        return 86
    if a.shrink:
        b.low_latency_query_mask_buffer(mask)
        torch.cuda.synchronize()
        print(f"FINISHED {checked} pairs, mask {mask.tolist()}", flush=True)
    else:
        print(f"FINISHED {checked} pairs", flush=True)
    return 0


# ---- the driver -------------------------------------------------------------------------------

def trial(a, kind, seed, rng):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--seed", str(seed), "--timeout-s", str(a.timeout_s)]
                              + (["--shrink"] if a.shrink else []),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              text=True)
             for r in range(2)]
    lines = [[], []]
    try:
        for r, p in enumerate(procs):  # both READY (bounded)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ln = p.stdout.readline()
                if not ln:
                    break
                lines[r].append(ln.rstrip())
                if ln.startswith("READY"):
                    break
        if not all(any(x.startswith("READY") for x in ls) for ls in lines):
            return dict(kind=kind, status="setup-failed", detail=" | ".join(lines[0][-3:] + lines[1][-3:]))
        victim = rng.randrange(2)
        survivor = 1 - victim
        time.sleep(rng.uniform(0.05, 1.0))
        t_fault = time.monotonic()
        if procs[victim].poll() is not None:
            return dict(kind=kind, status="victim-already-exited", detail="")
        os.kill(procs[victim].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        limit = a.timeout_s + 1.0 if not a.shrink else a.timeout_s * 4 + 30
        try:
            out, _ = procs[survivor].communicate(timeout=limit + 60)
        except subprocess.TimeoutExpired:
            return dict(kind=kind, status="HANG", detail=f"survivor {survivor} alive after "
                                                         f"{limit + 60:.0f} s")
        t_end = time.monotonic() - t_fault
        text = [x for x in out.splitlines() if x.startswith(("RAISED", "FINISHED", "WRONG"))]
        last = text[-1] if text else "<no result line>"
        rc = procs[survivor].returncode
        if a.shrink:
            want_mask = [1 if r == victim else 0 for r in range(2)]
            ok = rc == 0 and last.startswith("FINISHED") and f"mask {want_mask}" in last
            status = "pass" if ok else "FAIL"
        else:
            named = f"rank {victim}" in last or f"peer {victim}" in last
            if rc == 0 and last.startswith("FINISHED"):
                status = "finished-before-fault"
            elif rc == 86 and named and t_end <= limit:
                status = "pass"
            else:
                status = "FAIL"
        return dict(kind=kind, status=status, detect=t_end, victim=victim, detail=last)
    finally:
        for p in procs:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--shrink", action="store_true")
    ap.add_argument("--kinds", default="kill,stall")
    a = ap.parse_args()
    if not 0.001 <= a.timeout_s <= 60:
        ap.error("--timeout-s: between 0.001 and 60 seconds")
    if a.rank is not None:
        sys.exit(rank_main(a))
    rng = random.Random(a.seed)
    results = []
    mode = "shrink" if a.shrink else "raise"
    for kind in a.kinds.split(","):
        if kind not in ("kill", "stall"):
            ap.error(f"--kinds: kill and/or stall, got {kind!r}")
        for i in range(a.trials):
            r = trial(a, kind, rng.randrange(1 << 30), rng)
            results.append(r)
            det = f"{r['detect']:.2f} s" if "detect" in r else "-"
            print(f"[{mode} {kind} #{i + 1}] {r['status']} victim={r.get('victim')} "
                  f"end after fault {det}: {r['detail']}", flush=True)
    print(f"\n== Python Buffer fault trials ({mode}, wait bound {a.timeout_s} s, limit "
          f"{'wait bound + 1 s' if not a.shrink else 'finish all calls'})")
    print("kind   trials  pass  other  FAIL/HANG  end after fault s min/median/max (passes)")
    bad = 0
    for kind in a.kinds.split(","):
        rs = [r for r in results if r["kind"] == kind]
        p = [r for r in rs if r["status"] == "pass"]
        f = [r for r in rs if r["status"] in ("FAIL", "HANG", "setup-failed")]
        bad += len(f)
        ds = sorted(r["detect"] for r in p)
        fig = f"{ds[0]:.2f} / {ds[len(ds) // 2]:.2f} / {ds[-1]:.2f}" if ds else "-"
        print(f"{kind:6} {len(rs):6} {len(p):5} {len(rs) - len(p) - len(f):6} {len(f):10}  {fig}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
