"""Fault trials of the Python Buffer (issues 20 and 28), on a GPU machine with torch.

    python faults.py [--trials N] [--timeout-s S] [--shrink] [--seed N]
                     [--kinds kill,stall,skip-dispatch,skip-combine]

Every trial runs two ranks (this file with ``--rank``; their own gloo rendezvous on a free port,
not torchrun, which would end the survivor when its peer dies), both on GPU 0 unless there are
two, each with a ``Buffer(timeout_s=S)`` (``enable_shrink=True`` with ``--shrink``), making the
same dispatch+combine pairs with fresh inputs from a shared seed and classifying every pair's
outputs before it looks for an error: bitwise the oracle's (good), the contract's failed outputs
(a dispatch that received nothing, a combine of NaN rows), or WRONG (finite and wrong: the trial
fails, whatever else happens).

- ``kill``, ``stall``: at a random moment the driver stops one rank, chosen at random: SIGKILL
  or SIGSTOP. Without ``--shrink`` the survivor must raise (an ``ep_dispatch`` error naming the
  lost rank) within the wait bound + 1 s of the fault. With ``--shrink`` it must finish all its
  calls, each pair equal to the oracle on the routing the rank mask leaves (the mask read after
  the dispatch and after the combine), with the lost rank in its mask at the end. A fresh pair
  of processes per trial.
- ``skip-dispatch``, ``skip-combine`` (not with ``--shrink``): one rank, chosen at
  random, is late for one call chosen at random (it sleeps 3x the wait bound before that call's
  dispatch, or before its combine), then carries on. Both ranks must raise (the one that waited:
  the timeout naming the late rank, within the bound + 1 s of the fault; the late rank: the
  peer's failure, within 1 s of waking), each right after its first failed pair, and no pair of
  either may be WRONG. The trials of a kind run in one pair of processes, a new Buffer each.

Prints one line per trial (each rank's time from the fault to its raise) and a summary table
with the WRONG pairs counted; exits 0 when every trial passed.
"""

import argparse
import json
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

def outcome(oracle, rx, cnt, h, out, want_d, want_c):
    """``oracle.outcome`` of one pair: 'good', 'failed' (the contract's failed outputs) or
    'WRONG: ...' (a finite wrong output)."""
    got = types.SimpleNamespace(recv_x=rx, recv_x_scales=None, recv_count=cnt,
                                layout_range=h.layout_range, src_info=h.src_info)
    return oracle.outcome(got, want_d, out, want_c)


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

    def expect(ins):
        want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E, use_fp8=False)
        want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                                T, E)
        return want[rank], want_c[rank]

    def warm_buffer():
        """A new Buffer, its group formed (compiled or loaded) by one pair."""
        b = ep.Buffer(dist.group.WORLD, timeout_s=a.timeout_s, enable_shrink=a.shrink)
        x, topk, w, y = (t.to(dev) for t in inputs()[rank])
        _, _, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        b.low_latency_combine(y, topk, w, h)
        torch.cuda.synchronize()
        return b

    if a.skip:
        return skip_trials_rank(a, ep, dist, torch, oracle, dev, g, inputs, expect, warm_buffer)

    def masked(ins, m):
        routing = oracle.masked_routing([i[1] for i in ins], E, {d for d in range(R) if m[d]})
        return [(x, t, w, y) for (x, _, w, y), t in zip(ins, routing)]

    mask = torch.zeros(R, dtype=torch.int32, device=dev)
    b = warm_buffer()
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
            if a.shrink:
                eff = masked(ins, md)
                want = oracle.dispatch([i[0] for i in eff], [i[1] for i in eff], T, E,
                                       use_fp8=False)[rank]
                # Rows where this call's dispatch put them; the slots of ranks masked since
                # drop out (a zero weight drops a slot bit for bit).
                ws = []
                for r, (_, t, wt, _) in enumerate(eff):
                    wz = wt.clone()
                    for d in range(R):
                        if mc[d] and not md[d]:
                            wz[(t >= 0) & (t // L == d)] = 0.0
                    ws.append(wz)
                want_c = oracle.combine([i[3] for i in eff], [i[1] for i in eff], ws, T,
                                        E)[rank]
            else:
                want, want_c = expect(ins)
            # Every pair is classified before the error is looked for: a failed pair's outputs
            # must be the contract's failed ones, never finite and wrong.
            o = outcome(oracle, rx, cnt, h, out, want, want_c)
            if o.startswith("WRONG"):
                print(f"WRONG call {call}: {o}", flush=True)
                return 3
            # An engine learns of a failed call at its next call; this harness looks between
            # calls (no synchronisation needed: poll reads host memory the kernels write).
            b.poll()
            if o == "failed":
                print(f"SILENT call {call}: failed outputs and no error recorded", flush=True)
                return 4
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


def skip_trials_rank(a, ep, dist, torch, oracle, dev, g, inputs, expect, warm_buffer):
    """One rank's side of ``a.trials`` skip trials (``a.skip``: 'dispatch' or 'combine'), one
    Buffer each: the late rank and call are drawn from the shared seed, every pair is
    classified, the trial ends at this rank's raise (or after the late call + 4 pairs). Rank 0
    prints one TRIAL line per trial with both ranks' results (wall-clock seconds)."""
    rank, E = a.rank, E_PER_RANK * 2
    rng = random.Random(a.seed)
    for trial in range(a.trials):
        late, late_call = rng.randrange(2), rng.randrange(2, 30)
        g.manual_seed(a.seed * 1000 + trial)  # both ranks draw the same inputs, call by call
        b = warm_buffer()
        dist.barrier()
        outcomes, t_fault, raised, t_raised = [], None, None, None
        for call in range(late_call + 4):
            ins = inputs()
            want, want_c = expect(ins)
            x, topk, w, y = (t.to(dev) for t in ins[rank])
            if rank == late and call == late_call and a.skip == "dispatch":
                t_fault = time.time()
                time.sleep(3 * a.timeout_s)
            try:
                rx, cnt, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
            except ep.EpError as e:
                raised, t_raised = f"{type(e).__name__}/{e.kind}: {e}", time.time()
                break
            if rank == late and call == late_call and a.skip == "combine":
                t_fault = time.time()
                time.sleep(3 * a.timeout_s)
            try:
                out, _, _ = b.low_latency_combine(y, topk, w, h)
            except ep.EpError as e:
                # Raised at the combine's entry (its dispatch's kernel recorded the error by
                # then): the dispatch's outputs must be the failed ones; the combine never ran
                # (NaN rows stand for it).
                raised, t_raised = f"{type(e).__name__}/{e.kind}: {e}", time.time()
                torch.cuda.synchronize()
                out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
                outcomes.append(outcome(oracle, rx, cnt, h, out, want, want_c))
                break
            torch.cuda.synchronize()
            outcomes.append(outcome(oracle, rx, cnt, h, out, want, want_c))
        mine = dict(outcomes=outcomes, raised=raised, t_raised=t_raised, t_fault=t_fault,
                    at=len(outcomes))
        both = [None, None]
        dist.all_gather_object(both, mine)
        if rank == 0:
            print("TRIAL " + json.dumps(dict(trial=trial, late=late, call=late_call,
                                             ranks=both)), flush=True)
        b.destroy()
        dist.barrier()
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
        text = [x for x in out.splitlines()
                if x.startswith(("RAISED", "FINISHED", "WRONG", "SILENT"))]
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
        return dict(kind=kind, status=status, detect=t_end, victim=victim, detail=last,
                    wrong=int(last.startswith("WRONG")))
    finally:
        for p in procs:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()


def skip_trials(a, kind, seed):
    """The ``a.trials`` trials of a skip kind in one pair of processes; one result per trial."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    where = kind.split("-", 1)[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--seed", str(seed), "--timeout-s", str(a.timeout_s),
                               "--trials", str(a.trials), "--skip", where],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              text=True)
             for r in range(2)]
    limit = a.trials * (3 * a.timeout_s + 10) + 120
    try:
        outs = [p.communicate(timeout=limit)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [dict(kind=kind, status="HANG", detail=f"still running after {limit:.0f} s",
                     wrong=0)]
    results = []
    for ln in outs[0].splitlines():
        if not ln.startswith("TRIAL "):
            continue
        t = json.loads(ln[len("TRIAL "):])
        late, ranks = t["late"], t["ranks"]
        t0 = ranks[late]["t_fault"]
        wrong = sum(o.startswith("WRONG") for r in ranks for o in r["outcomes"])
        why = []
        for rk, r in enumerate(ranks):
            o = r["outcomes"]
            if r["raised"] is None:
                why.append(f"rank {rk} never raised")
            elif not (o and o[-1] == "failed" and "failed" not in o[:-1]):
                why.append(f"rank {rk} raised at call {r['at']}, not right after its first "
                           f"failed pair: {o[t['call']:]}")
        det = [None if r["t_raised"] is None or t0 is None else r["t_raised"] - t0
               for r in ranks]
        waiter, late_r = ranks[1 - late], ranks[late]
        if waiter["raised"] and f"peer {late}" not in waiter["raised"] and \
                f"rank {late}" not in waiter["raised"]:
            why.append(f"rank {1 - late} did not name the late rank: {waiter['raised']}")
        if late_r["raised"] and "PeerFailed" not in late_r["raised"]:
            why.append(f"the late rank raised {late_r['raised']}, not PeerFailed")
        if det[1 - late] is not None and det[1 - late] > a.timeout_s + 1.0:
            why.append(f"rank {1 - late} raised {det[1 - late]:.2f} s after the fault")
        if det[late] is not None and det[late] > 3 * a.timeout_s + 1.0:
            why.append(f"the late rank raised {det[late] - 3 * a.timeout_s:.2f} s after waking")
        status = "FAIL" if wrong or why else "pass"
        results.append(dict(kind=kind, status=status, wrong=wrong, victim=late,
                            detect=det[1 - late], late_detect=None if det[late] is None
                            else det[late] - 3 * a.timeout_s,
                            detail="; ".join(why) or f"call {t['call']}: "
                            + " | ".join(f"rank {k}: {r['raised']}" for k, r in enumerate(ranks))))
    if len(results) < a.trials:
        tail = " | ".join(outs[0].splitlines()[-3:] + outs[1].splitlines()[-3:])
        results.append(dict(kind=kind, status="FAIL", wrong=0,
                            detail=f"{a.trials - len(results)} trials missing: {tail}"))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--shrink", action="store_true")
    ap.add_argument("--kinds", default="kill,stall")
    ap.add_argument("--skip", choices=["dispatch", "combine"],
                    help=argparse.SUPPRESS)  # a rank of the skip trials
    a = ap.parse_args()
    if not 0.001 <= a.timeout_s <= 60:
        ap.error("--timeout-s: between 0.001 and 60 seconds")
    kinds = a.kinds.split(",")
    for kind in kinds:
        if kind not in ("kill", "stall", "skip-dispatch", "skip-combine"):
            ap.error(f"--kinds: kill, stall, skip-dispatch, skip-combine, got {kind!r}")
        if a.shrink and kind.startswith("skip"):
            ap.error(f"--kinds: {kind} runs without --shrink")
    if a.rank is not None:
        sys.exit(rank_main(a))
    rng = random.Random(a.seed)
    results = []
    mode = "shrink" if a.shrink else "raise"
    for kind in kinds:
        if kind.startswith("skip"):
            rs = skip_trials(a, kind, rng.randrange(1 << 30))
        else:
            rs = [trial(a, kind, rng.randrange(1 << 30), rng) for _ in range(a.trials)]
        for i, r in enumerate(rs):
            results.append(r)
            det = f"{r['detect']:.2f} s" if r.get("detect") is not None else "-"
            late = (f", late rank raised {r['late_detect']:.3f} s after waking"
                    if r.get("late_detect") is not None else "")
            print(f"[{mode} {kind} #{i + 1}] {r['status']} victim={r.get('victim')} "
                  f"end after fault {det}{late}: {r['detail']}", flush=True)
    print(f"\n== Python Buffer fault trials ({mode}, wait bound {a.timeout_s} s, limit "
          f"{'wait bound + 1 s' if not a.shrink else 'finish all calls'})")
    print("kind           trials  pass  other  FAIL/HANG  WRONG pairs  end after fault s "
          "min/median/max (passes)  late rank after waking s")
    bad = 0
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        p = [r for r in rs if r["status"] == "pass"]
        f = [r for r in rs if r["status"] in ("FAIL", "HANG", "setup-failed")]
        bad += len(f)

        def fig(key):
            ds = sorted(r[key] for r in p if r.get(key) is not None)
            return f"{ds[0]:.3f} / {ds[len(ds) // 2]:.3f} / {ds[-1]:.3f}" if ds else "-"
        print(f"{kind:14} {len(rs):6} {len(p):5} {len(rs) - len(p) - len(f):6} {len(f):10} "
              f"{sum(r.get('wrong', 0) for r in rs):12}  {fig('detect'):30}  {fig('late_detect')}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
