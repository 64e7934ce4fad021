"""The GPU Buffer, as a user runs it: one rank per process under
``torchrun --nproc-per-node N -m pytest python/tests/test_gpu.py`` (or plain ``pytest``: one
rank). Every rank builds every rank's inputs from the same seed, so each checks its own outputs
against the oracle bit for bit without extra communication.

Every Buffer test runs on each (path, transport) of ``SETUPS``: NVLink over CUDA IPC on both
paths, and the batched path over NCCL ('nccl': every peer, this rank included) and over the
two-tier transport with one emulated node per rank (so NCCL carries every peer there too).
``-k nccl`` or ``-k two-tier`` selects those.

Skipped, with the reason, where torch, a GPU or this build's GPU execution is missing; the NCCL
transports also where libnccl cannot be loaded or two ranks share a GPU (NCCL refuses that).
"""

import datetime
import os
import socket
import types

import pytest

import ep_dispatch as ep
from ep_dispatch import oracle

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests need it)")
np = pytest.importorskip("numpy", reason="numpy is not installed")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)
if ep.DEVICE_API is None:
    pytest.skip("this build of ep_dispatch has no GPU device API", allow_module_level=True)

T, H, K = 16, 512, 4  # H % 512 == 0: every FP8 mode, UE8M0 included
MODES = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8-round": dict(use_fp8=True, round_scale=True),
    "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}
# (path, transport): the per-expert path runs on 'auto' only (over NCCL it needs exact sizes,
# which the stream-ordered Buffer refuses). 'two-tier' runs with one emulated node per rank
# (EP_NODE_ID = rank while the group forms): every peer through NCCL, this rank through itself.
SETUPS = [("batched", "auto"), ("per_expert", "auto"), ("batched", "nccl"),
          ("batched", "two-tier")]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def group():
    """The process group: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR...) or a group of one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=120)
        if "WORLD_SIZE" in os.environ:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % torch.cuda.device_count())
            dist.init_process_group("gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    return dist.group.WORLD


@pytest.fixture(scope="session")
def R(group):
    return group.size()


@pytest.fixture(scope="session")
def E(R):
    return 4 * R


def make_buffer(group, R, E, **kw):
    # As DeepEP's tests make theirs; the DeepEP keywords are accepted and ignored.
    hint = ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E,
                                                    transport=kw.get("transport", "auto"))
    return ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                     num_qps_per_rank=E // R, **kw)


@pytest.fixture(scope="session")
def nccl_skip(group):
    """Why the NCCL transports cannot run in this group (the same answer on every rank, so no
    rank starts a collective step the others skip), or None."""
    import torch.distributed as dist

    try:
        ep._native.probe_transport("nccl")
        why = None
    except ep.NoDeviceError as e:
        why = str(e)
    everyone = [None] * group.size()
    dist.all_gather_object(everyone, (socket.gethostname(), torch.cuda.current_device(), why),
                           group=group)
    missing = [f"rank {r}: {w}" for r, (_, _, w) in enumerate(everyone) if w]
    if missing:
        return "; ".join(missing)
    gpus = {(host, dev) for host, dev, _ in everyone}
    if len(gpus) < len(everyone):
        return (f"NCCL needs one GPU per rank, and these {len(everyone)} ranks share "
                f"{len(gpus)} GPU(s)")
    return None


def skip_without_nccl(transport, why):
    if transport != "auto" and why is not None:
        print(f"SKIPPED: transport={transport!r}: {why}")
        pytest.skip(f"transport={transport!r}: {why}")


def emulate_nodes(b, node):
    """Makes `b` form its groups with EP_NODE_ID = `node` (the node id is read when a group
    forms, at the first dispatch of each shape), leaving the environment as it was after."""
    form = b._rank_group

    def rank_group(*args):
        old = os.environ.get("EP_NODE_ID")
        os.environ["EP_NODE_ID"] = node
        try:
            return form(*args)
        finally:
            if old is None:
                del os.environ["EP_NODE_ID"]
            else:
                os.environ["EP_NODE_ID"] = old

    b._rank_group = rank_group


@pytest.fixture(scope="module", params=SETUPS, ids=[f"{p}-{t}" for p, t in SETUPS])
def buf(request, group, R, E, nccl_skip):
    path, transport = request.param
    skip_without_nccl(transport, nccl_skip)
    b = make_buffer(group, R, E, path=path, transport=transport)
    if transport == "two-tier":
        emulate_nodes(b, f"node{group.rank()}")
    yield b
    b.destroy()


def inputs(seed, R, E, n=None, masked=0.1):
    """Every rank's (x bf16 [n_r, H], topk_idx int64 [n_r, K], topk_weights f32, y bf16
    [L, R*T, H]) on the host, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    L = E // R
    out = []
    for _ in range(R):
        nr = int(torch.randint(0, T + 1, (1,), generator=g)) if n is None else n
        x = (torch.randn(nr, H, generator=g) * 4).to(torch.bfloat16)
        topk = torch.rand(nr, E, generator=g).argsort(dim=1)[:, :K].to(torch.int64)
        topk[torch.rand(nr, K, generator=g) < masked] = -1
        w = torch.randn(nr, K, generator=g)
        y = torch.randn(L, R * T, H, generator=g).to(torch.bfloat16)
        out.append((x, topk, w, y))
    return out


def on_gpu(t):
    return t.to(f"cuda:{torch.cuda.current_device()}").contiguous()


def got_of(recv_x, recv_count, handle):
    x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    return types.SimpleNamespace(recv_x=x, recv_x_scales=scales, recv_count=recv_count,
                                 layout_range=handle.layout_range, src_info=handle.src_info)


def expect(ins, E, mode):
    want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E, **mode)
    want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    return want, want_c


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("seed", [1, 2])
def test_dispatch_and_combine_match_the_oracle(buf, group, R, E, mode, seed):
    rank = group.rank()
    ins = inputs(seed, R, E)
    want, want_c = expect(ins, E, MODES[mode])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk, T, E, **MODES[mode])
    combined, cevent, chook = buf.low_latency_combine(y, topk, w, handle)
    torch.cuda.synchronize()
    buf.check()
    # Every check after both collective calls, so a failure on one rank cannot strand the other.
    assert event.event is None and hook is None and cevent.event is None and chook is None
    if MODES[mode]["use_fp8"]:
        assert recv_x[0].dtype == torch.float8_e4m3fn and recv_x[0].shape == (E // R, R * T, H)
        scales_shape = (E // R, R * T, H // (512 if mode == "fp8-ue8m0" else 128))
        assert recv_x[1].shape == scales_shape
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (E // R, R * T, H)
    assert recv_count.dtype == torch.int32 and recv_count.shape == (E // R,)
    assert oracle.diff(got_of(recv_x, recv_count, handle), want[rank]) is None
    assert combined.shape == (x.shape[0], H) and combined.dtype == torch.bfloat16
    assert oracle.combine_diff(combined, want_c[rank]) is None


def test_recv_hook_split(buf, group, R, E):
    rank = group.rank()
    ins = inputs(3, R, E)
    want, want_c = expect(ins, E, MODES["fp8"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x, topk, T, E, return_recv_hook=True)
    assert callable(hook)
    torch.ones(1024, device=x.device).sum()  # other work on the stream between the halves
    hook()
    combined, _, chook = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
    assert callable(chook)
    chook()
    torch.cuda.synchronize()
    buf.check()
    assert oracle.diff(got_of(recv_x, recv_count, handle), want[rank]) is None
    assert oracle.combine_diff(combined, want_c[rank]) is None


def test_async_finish_out_and_stats(buf, group, R, E):
    rank = group.rank()
    ins = inputs(4, R, E)
    want, want_c = expect(ins, E, MODES["bf16"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    stats = torch.full((E // R,), 5, dtype=torch.int32, device=x.device)
    recv_x, recv_count, handle, event, _ = buf.low_latency_dispatch(
        x, topk, T, E, stats, use_fp8=False, async_finish=True)
    assert isinstance(event, ep.EventOverlap) and event.event is not None
    event.current_stream_wait()
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=x.device)
    combined, event, _ = buf.low_latency_combine(y, topk, w, handle, async_finish=True, out=out)
    with event:
        pass
    torch.cuda.synchronize()
    buf.check()
    assert combined.data_ptr() == out.data_ptr()
    assert oracle.diff(got_of(recv_x, recv_count, handle), want[rank]) is None
    assert oracle.combine_diff(out, want_c[rank]) is None
    assert (stats.cpu() - 5).tolist() == want[rank].recv_count.tolist()


def test_zero_copy_combine_buffer(buf, group, R, E):
    rank = group.rank()
    ins = inputs(5, R, E)
    _, want_c = expect(ins, E, MODES["fp8"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    _, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    zbuf = buf.get_next_low_latency_combine_buffer(handle)
    zbuf.copy_(y)
    garbage = torch.zeros_like(y)
    combined, _, _ = buf.low_latency_combine(garbage, topk, w, handle, zero_copy=True)
    torch.cuda.synchronize()
    buf.check()
    assert oracle.combine_diff(combined, want_c[rank]) is None


def test_cuda_graph_capture_and_replay(buf, group, R, E):
    rank = group.rank()
    n = T // 2
    first = inputs(6, R, E, n=n)
    sx, stopk, sw, sy = (on_gpu(t) for t in first[rank])
    # Warm up eagerly (forms the group: collective, not capturable), then capture both calls.
    _, _, h0, _, _ = buf.low_latency_dispatch(sx, stopk, T, E)
    buf.low_latency_combine(sy, stopk, sw, h0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(sx, stopk, T, E)
        combined, _, _ = buf.low_latency_combine(sy, stopk, sw, handle)
    for seed in (7, 8):
        ins = inputs(seed, R, E, n=n)
        want, want_c = expect(ins, E, MODES["fp8"])
        x, topk, w, y = ins[rank]
        sx.copy_(x)
        stopk.copy_(topk)
        sw.copy_(w)
        sy.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        buf.check()
        assert oracle.diff(got_of(recv_x, recv_count, handle), want[rank]) is None, seed
        assert oracle.combine_diff(combined, want_c[rank]) is None, seed


def logfmt_inputs(seed, R, E):
    """``inputs`` with full ranks and the expert outputs scaled as the kernels' tests scale them:
    each group of 128 channels whose (row + group) is not a multiple of 4 times 2^-4 (values
    mostly below 1: it packs), the rest as drawn (|y| >= 1 somewhere: it travels raw)."""
    out = []
    for x, topk, w, y in inputs(seed, R, E, n=T):
        rows = torch.arange(y.shape[0] * y.shape[1]).reshape(y.shape[0], y.shape[1], 1)
        groups = torch.arange(H // 128).repeat_interleave(128).reshape(1, 1, H)
        scale = torch.where((rows + groups) % 4 != 0, 0.0625, 1.0)
        out.append((x, topk, w, (y.float() * scale).to(torch.bfloat16)))
    return out


@pytest.mark.parametrize("hook", [False, True], ids=["whole", "hook"])
def test_logfmt_combine_matches_the_oracle(buf, group, R, E, hook):
    """use_logfmt=True: the oracle's LogFMT combine bit for bit (which differs from the bf16
    one here, so an ignored flag fails); a bf16 combine after it still matches. Where a peer is
    reached over NCCL it is refused (UnsupportedError naming NCCL) before anything is enqueued,
    and the same dispatch then combines in bf16 (the transport's name does not decide it: on
    'two-tier' one rank has no peer, so no NCCL peer, and LogFMT runs)."""
    rank = group.rank()
    ins = logfmt_inputs(10, R, E)
    args = ([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    want_lf = oracle.combine(*args, use_logfmt=True)
    want_bf = oracle.combine(*args)
    assert any(oracle.combine_diff(a, b) is not None for a, b in zip(want_lf, want_bf))
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    _, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    if any(g.nccl_mask() for g in buf._ranks.values()):
        with pytest.raises(ep.UnsupportedError) as e:
            buf.low_latency_combine(y, topk, w, handle, use_logfmt=True, return_recv_hook=hook)
        assert "NCCL" in str(e.value) and "LogFMT" in str(e.value)
        lf = None
    else:
        lf, _, chook = buf.low_latency_combine(y, topk, w, handle, use_logfmt=True,
                                               return_recv_hook=hook)
        if hook:
            chook()
        _, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    # The refused combine left its dispatch to combine: in bf16 now.
    bf, _, _ = buf.low_latency_combine(y, topk, w, handle)
    torch.cuda.synchronize()
    buf.check()
    if lf is not None:
        assert oracle.combine_diff(lf, want_lf[rank]) is None
    assert oracle.combine_diff(bf, want_bf[rank]) is None


def test_bad_arguments_raise_before_any_launch(buf, group, R, E):
    ins = inputs(9, R, E, n=4)
    x, topk, w, y = (on_gpu(t) for t in ins[group.rank()])
    cases = [
        (dict(x=x.float()), "x"),
        (dict(x=x.cpu()), "x"),
        (dict(x=torch.empty(H, 4, dtype=torch.bfloat16, device=x.device).t()), "x"),
        (dict(topk_idx=topk.int()), "topk_idx"),
        (dict(topk_idx=topk[:3]), "topk_idx"),
        (dict(num_max_dispatch_tokens_per_rank=2), "x"),
        (dict(num_experts=E + 1), "num_experts"),
    ]
    for change, argument in cases:
        args = dict(x=x, topk_idx=topk, num_max_dispatch_tokens_per_rank=T, num_experts=E)
        args.update(change)
        with pytest.raises(ep.ArgumentError) as e:
            buf.low_latency_dispatch(**args)
        assert e.value.argument == argument, str(e.value)
    with pytest.raises(ep.ConfigError):
        buf.low_latency_dispatch(x, topk, T, E, use_ue8m0=True)  # without round_scale
    # The buffer is still usable; a combine with a foreign or stale handle is refused.
    _, _, h1, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    with pytest.raises(ep.InputError):
        buf.low_latency_combine(y, topk, w, tuple(h1))
    with pytest.raises(ep.ArgumentError) as e:
        buf.low_latency_combine(y[..., : H // 2], topk, w, h1)
    assert e.value.argument == "x"
    with pytest.raises(ep.ArgumentError) as e:  # topk_idx of another shape
        buf.low_latency_combine(y, topk[:, :1].contiguous(), w, h1)
    assert e.value.argument == "topk_idx"
    # Two dispatches in flight use the two buffer sets; a third reuses h1's set: h1 is stale.
    _, _, h2, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    _, _, h3, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    with pytest.raises(ep.InputError):
        buf.low_latency_combine(y, topk, w, h1)
    # Equal values at another address combine (vLLM's EPLB passes a remapped copy).
    buf.low_latency_combine(y, topk.clone(), w, h2)
    buf.low_latency_combine(y, topk, w, h3)
    torch.cuda.synchronize()
    buf.check()


def test_bad_routing_is_refused(group, R, E):
    ins = inputs(10, R, E, n=2, masked=0.0)
    x, topk, _, _ = (on_gpu(t) for t in ins[group.rank()])
    topk[1, 1] = topk[1, 0]  # the same expert twice, on every rank
    # Checked on the host (check_routing=True): raised before anything is launched.
    b = make_buffer(group, R, E, check_routing=True)
    with pytest.raises(ep.InputError) as e:
        b.low_latency_dispatch(x, topk, T, E)
    assert e.value.kind == "DuplicateExpert" and (e.value.token, e.value.second_slot) == (1, 1)
    b.destroy()
    # Checked on the device: the kernels stop, Buffer.check() names it.
    b = make_buffer(group, R, E, timeout_s=2.0)
    b.low_latency_dispatch(x, topk, T, E)
    torch.cuda.synchronize()
    with pytest.raises((ep.InputError, ep.TimeoutError)) as e:
        b.check()
    assert e.value.kind in ("DuplicateExpert", "Timeout"), str(e.value)
    b.destroy()


def test_peers_are_reached_as_the_transport_plans(buf, group, R, E):
    """Which peers NCCL carries: none on 'auto', every rank (itself included) on 'nccl', every
    other rank on the emulated 'two-tier' (one node per rank). So a transport that silently fell
    back to CUDA IPC fails here, and the bitwise tests above ran over the transport named."""
    rank = group.rank()
    ins = inputs(11, R, E)
    want, want_c = expect(ins, E, MODES["bf16"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(y, topk, w, handle)
    torch.cuda.synchronize()
    buf.check()
    everyone = (1 << R) - 1
    planned = {"auto": 0, "nccl": everyone, "two-tier": everyone & ~(1 << rank)}[buf.transport]
    masks = {g.nccl_mask() for g in buf._ranks.values()}
    assert masks == {planned}, (buf.transport, masks, planned)
    assert oracle.diff(got_of(recv_x, recv_count, handle), want[rank]) is None
    assert oracle.combine_diff(combined, want_c[rank]) is None


@pytest.mark.parametrize("transport", ["nccl", "two-tier"])
def test_per_expert_over_nccl_raises_unsupported(group, R, E, transport):
    # The Buffer refuses it when made, before any collective step.
    with pytest.raises(ep.UnsupportedError) as e:
        make_buffer(group, R, E, path="per_expert", transport=transport)
    assert "exact sizes" in str(e.value) and "host round trip" in str(e.value), str(e.value)

    # So does the native rank itself, before the exchange (all_gather is never called).
    def no_exchange(blob):
        raise AssertionError("the refused group started its exchange")

    with pytest.raises(ep.UnsupportedError) as e:
        spec = ep._native.CallSpec(R, E, T, H, K, True, False, False,
                                   torch.cuda.current_device(), buf_dtypes())
        ep._native.GpuRank(spec, group.rank(), "per_expert", transport, 10.0, no_exchange)
    assert e.value.kind == "Unsupported" and "path='batched'" in str(e.value), str(e.value)


def buf_dtypes():
    """The dtypes a native CallSpec compares tensors' with, in its order."""
    return (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64)


def _poll_until_raises(b, limit_s=5.0):
    """Polls `b` (no synchronisation) until it raises; returns the exception."""
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            b.poll()
        except ep.EpError as e:
            return e
        time.sleep(0.001)
    raise AssertionError(f"no error reached the host in {limit_s} s")


@pytest.mark.parametrize("path", ["batched", "per_expert"])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_lost_peer_raises_at_the_next_call(group, R, E, op, path):
    """Rank 0 stops signalling (the test hook): every rank's wait for it runs
    out, the next call on each rank raises the TimeoutError naming rank 0 at its entry (no
    check(), no synchronisation), and the failed call's outputs are the contract's: a failed
    dispatch receives nothing, a failed combine's rows are NaN."""
    if R == 1 and path == "batched":
        pytest.skip("one rank's batched calls write the canonical rows directly: no wait to lose")
    rank = group.rank()
    ins = inputs(11, R, E, n=T)
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    b = make_buffer(group, R, E, timeout_s=0.2, path=path)
    _, _, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    b.low_latency_combine(y, topk, w, h)
    torch.cuda.synchronize()
    b.poll()
    (g,) = b._ranks.values()
    if op == "combine":
        _, count, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        torch.cuda.synchronize()
        b.poll()
    g._set_fault_rank(0)
    if op == "dispatch":
        _, count, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        failed = count
    else:
        failed, _, _ = b.low_latency_combine(y, topk, w, h)
    err = _poll_until_raises(b)
    assert isinstance(err, ep.TimeoutError), repr(err)
    assert (err.peer, err.call) == (0, 2), str(err)
    assert err.phase.startswith(op), str(err)
    # The next call raises the same error at its entry.
    with pytest.raises(ep.TimeoutError) as again:
        b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    assert str(again.value) == str(err)
    torch.cuda.synchronize()
    if op == "dispatch":
        assert failed.tolist() == [0] * (E // R)
        assert (h.layout_range == 0).all()
    else:
        assert failed.isnan().all(), "a failed combine's rows are NaN"
    b.destroy()


def test_a_lost_hook_leaves_the_buffer_usable(group, R, E):
    """A send half whose hook is never called: the next dispatch that reuses
    its buffer set (the third, with two in flight) enqueues its receive half first instead of
    refusing (which would refuse every later call too); the lost hook, if called after all,
    does nothing. The live dispatches combine bit for bit."""
    rank = group.rank()
    ins = inputs(12, R, E)
    want, want_c = expect(ins, E, MODES["fp8"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    b = make_buffer(group, R, E)
    _, _, h1, _, lost = b.low_latency_dispatch(x, topk, T, E, return_recv_hook=True)
    _, _, h2, _, hook2 = b.low_latency_dispatch(x, topk, T, E, return_recv_hook=True)
    recv_x, recv_count, h3, _, hook = b.low_latency_dispatch(x, topk, T, E,
                                                             return_recv_hook=True)
    lost()  # its receive half already ran (before h3's send half, in h1's set)
    hook()
    hook2()
    with pytest.raises(ep.InputError):  # h1's state was replaced by h3's
        b.low_latency_combine(y, topk, w, h1)
    combined2, _, _ = b.low_latency_combine(y, topk, w, h2)
    _, _, clost = b.low_latency_combine(y, topk, w, h3, return_recv_hook=True)
    combined, _, chook = b.low_latency_combine(y, topk, w, h3, return_recv_hook=True)
    chook()
    clost()  # no-op
    torch.cuda.synchronize()
    b.check()
    assert oracle.diff(got_of(recv_x, recv_count, h3), want[rank]) is None
    assert oracle.combine_diff(combined, want_c[rank]) is None
    assert oracle.combine_diff(combined2, want_c[rank]) is None
    b.destroy()


@pytest.mark.parametrize("path", ["batched", "per_expert"])
def test_shrink_masks_a_lost_peer_and_cleans_back(group, R, E, path):
    """DeepEP's shrink mode: the last rank stops signalling (the test hook);
    every other rank masks it instead of raising, its outputs equal the oracle on the masked
    routing, and its mask (low_latency_query_mask_buffer) names the lost rank. A clean on
    every rank, then a barrier, brings the group back whole."""
    if R == 1:
        pytest.skip("one rank: no peer to lose")
    import torch.distributed as dist

    rank, lost = group.rank(), R - 1
    b = make_buffer(group, R, E, timeout_s=0.2, path=path, enable_shrink=True)
    ins = inputs(13, R, E)
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    _, _, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    b.low_latency_combine(y, topk, w, h)
    torch.cuda.synchronize()
    mask = torch.ones(R, dtype=torch.int32, device=x.device)
    b.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0] * R
    (g,) = b._ranks.values()
    g._set_fault_rank(lost)
    ins = inputs(14, R, E)
    routing = oracle.masked_routing([i[1] for i in ins], E, {lost})
    want, want_c = expect([(x, t, w, y) for (x, _, w, y), t in zip(ins, routing)], E,
                          MODES["bf16"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    recv_x, count, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    combined, _, _ = b.low_latency_combine(y, topk, w, h)
    b.low_latency_query_mask_buffer(mask)
    torch.cuda.synchronize()
    b.poll()  # a lost peer is masked, not an error
    if rank != lost:
        assert mask.tolist() == [0] * (R - 1) + [1]
        assert oracle.diff(got_of(recv_x, count, h), want[rank]) is None
        assert oracle.combine_diff(combined, want_c[rank]) is None
    # Back to a whole group: every rank cleans, then a barrier, then a call of everyone.
    g._set_fault_rank(None)
    b.low_latency_clean_mask_buffer()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    ins = inputs(15, R, E)
    want, want_c = expect(ins, E, MODES["fp8"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    recv_x, count, h, _, _ = b.low_latency_dispatch(x, topk, T, E)
    combined, _, _ = b.low_latency_combine(y, topk, w, h)
    b.low_latency_query_mask_buffer(mask)
    torch.cuda.synchronize()
    b.check()
    assert mask.tolist() == [0] * R
    assert oracle.diff(got_of(recv_x, count, h), want[rank]) is None
    assert oracle.combine_diff(combined, want_c[rank]) is None
    b.destroy()


def _real_deep_ep():
    """DeepEP's own build when it is importable (``EP_DEEPEP_PATH``: a checkout built in
    place), else None. Never our deepep_compat shim."""
    path = os.environ.get("EP_DEEPEP_PATH")
    if not path:
        return None
    import importlib
    import sys

    sys.path.insert(0, path)
    try:
        mod = importlib.import_module("deep_ep")
    except ImportError:
        return None
    finally:
        sys.path.remove(path)
    return None if getattr(mod, "Buffer", None) is ep.Buffer else mod


def _layout(t):
    return None if t is None else (tuple(t.shape), t.dtype, tuple(t.stride()))


@pytest.mark.parametrize("mode", ["bf16", "fp8", "ue8m0"])
def test_outputs_have_deepeps_shapes_dtypes_and_strides(group, R, mode):
    """Every tensor dispatch and combine return, with DeepEP's shapes, dtypes
    and strides; the FP8 scales column-major (strides (R*T*G, 1, R*T)). Where DeepEP's own build
    is importable (EP_DEEPEP_PATH), both Buffers make the same calls and every layout is
    compared with DeepEP's; without it the strides are compared with DeepEP's documented ones."""
    kw = dict(bf16=dict(use_fp8=False), fp8=dict(use_fp8=True),
              ue8m0=dict(use_fp8=True, round_scale=True, use_ue8m0=True))[mode]
    Ts, Hs, Es, Ks = 128, 7168, 8 * R, 4  # a DeepEP-supported hidden size
    torch.manual_seed(7 + group.rank())
    x = torch.randn(Ts, Hs, device="cuda").to(torch.bfloat16)
    topk = torch.stack([torch.randperm(Es, device="cuda")[:Ks] for _ in range(Ts)])
    w = torch.rand(Ts, Ks, device="cuda")

    def layouts(buf):
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk, Ts, Es, **kw)
        rx, sc = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        y = torch.zeros(Es // R, R * Ts, Hs, dtype=torch.bfloat16, device="cuda")
        combined, _, _ = buf.low_latency_combine(y, topk, w, handle)
        torch.cuda.synchronize()
        return dict(recv_x=_layout(rx), scales=_layout(sc), recv_count=_layout(count),
                    src_info=_layout(handle[0]), layout_range=_layout(handle[1]),
                    handle_ints=tuple(handle[2:5]), combined=_layout(combined))

    hint = ep.Buffer.get_low_latency_rdma_size_hint(Ts, Hs, R, Es)
    ours = ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=Es // R)
    got = layouts(ours)
    ours.check()
    ours.destroy()
    L, RT = Es // R, R * Ts
    G = Hs // (512 if mode == "ue8m0" else 128)
    if mode != "bf16":
        assert got["scales"] == ((L, RT, G), torch.int32 if mode == "ue8m0" else torch.float32,
                                 (RT * G, 1, RT)), got["scales"]
    assert got["recv_x"][0] == (L, RT, Hs) and got["recv_x"][2] == (RT * Hs, Hs, 1)
    assert got["recv_count"] == ((L,), torch.int32, (1,))
    assert got["layout_range"] == ((L, R), torch.int64, (R, 1))
    deep_ep = _real_deep_ep()
    if deep_ep is None or R > torch.cuda.device_count():
        why = ("its build is not importable (EP_DEEPEP_PATH)" if deep_ep is None else
               f"{R} ranks share {torch.cuda.device_count()} GPU(s) (NVSHMEM needs one each)")
        print(f"SKIPPED (part): DeepEP beside ours: {why}; strides compared with DeepEP's "
              "documented layout only")
        return
    theirs = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        Ts, Hs, R, Es), low_latency_mode=True, num_qps_per_rank=Es // R,
        explicitly_destroy=True)
    want = layouts(theirs)
    theirs.destroy()
    assert got == want, {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    print(f"ok: {mode}: every output's shape, dtype and strides equal DeepEP's ({want})")


@pytest.mark.parametrize("order", ["hooks", "hooks-combine-hooks", "no-hooks"])
def test_two_dispatches_in_flight_equal_one_at_a_time(group, R, E, order):
    """Two micro-batches in flight, as vLLM's dual-batch overlap and SGLang's
    two-batch overlap call them: dispatch A, dispatch B, (hook A, hook B,) combine A, combine B
    (combine A with a copy of its topk_idx at another address, as EPLB passes it). Every output
    equals the oracle of the same calls made one at a time, each batch with its own inputs."""
    rank = group.rank()
    ins_a, ins_b = inputs(31, R, E), inputs(32, R, E)
    (wa, wca), (wb, wcb) = expect(ins_a, E, MODES["fp8"]), expect(ins_b, E, MODES["fp8"])
    xa, ta, wta, ya = (on_gpu(t) for t in ins_a[rank])
    xb, tb, wtb, yb = (on_gpu(t) for t in ins_b[rank])
    b = make_buffer(group, R, E)
    hooked = order != "no-hooks"
    ra = b.low_latency_dispatch(xa, ta, T, E, return_recv_hook=hooked)
    rb = b.low_latency_dispatch(xb, tb, T, E, return_recv_hook=hooked)
    if hooked:
        ra[4]()
        rb[4]()
    ch = order == "hooks-combine-hooks"
    ca = b.low_latency_combine(ya, ta.clone(), wta, ra[2], return_recv_hook=ch)
    cb = b.low_latency_combine(yb, tb, wtb, rb[2], return_recv_hook=ch)
    if ch:
        ca[2]()
        cb[2]()
    torch.cuda.synchronize()
    b.check()
    assert oracle.diff(got_of(ra[0], ra[1], ra[2]), wa[rank]) is None
    assert oracle.diff(got_of(rb[0], rb[1], rb[2]), wb[rank]) is None
    assert oracle.combine_diff(ca[0], wca[rank]) is None
    assert oracle.combine_diff(cb[0], wcb[rank]) is None
    b.destroy()


@pytest.mark.parametrize("path", ["batched", "per_expert"])
@pytest.mark.parametrize("skip", ["dispatch", "combine"])
def test_a_peer_that_skips_a_call_hands_nobody_wrong_values(group, R, E, skip, path):
    """The last rank is late for call 2 (it sleeps 3x the wait bound before that
    call's dispatch, or before its combine), then carries on; fresh inputs every call, the
    default options. Every output of every call on every rank is bitwise the oracle's or the
    call's failed output (dispatch: no rows; combine: NaN rows), never finite and wrong; the
    first failed output on each rank is followed by a raise at that rank's next call (the
    combine of a failed dispatch, whose kernel has recorded its error by then, may raise at its
    entry already; the ranks that waited: TimeoutError naming the late rank; the late rank:
    PeerError, kind PeerFailed, from the poison of the ranks that failed). Prints each rank's
    time from the fault to its failed output and to its raise."""
    if R == 1:
        pytest.skip("one rank: no peer to be late for")
    import time

    import torch.distributed as dist

    rank, late, bound = group.rank(), R - 1, 0.5
    b = make_buffer(group, R, E, timeout_s=bound, path=path)
    dist.barrier(group=group)
    outcomes, raised, t_fault, t_failed, t_raised = [], None, None, None, None
    for call in range(6):
        ins = inputs(200 + call, R, E, n=T)
        want, want_c = expect(ins, E, MODES["bf16"])
        x, topk, w, y = (on_gpu(t) for t in ins[rank])
        try:
            if rank == late and call == 2 and skip == "dispatch":
                t_fault = time.time()
                time.sleep(3 * bound)
            recv_x, count, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        except ep.EpError as e:
            raised, t_raised = (call, e), time.time()
            break
        if rank == late and call == 2 and skip == "combine":
            t_fault = time.time()
            time.sleep(3 * bound)
        try:
            out, _, _ = b.low_latency_combine(y, topk, w, h)
        except ep.EpError as e:
            # Raised at the combine's entry: this call's dispatch failed, and its outputs must
            # be the failed ones (an all-NaN `out` stands for the combine that never ran).
            raised, t_raised = (call, e), time.time()
            torch.cuda.synchronize()
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=x.device)
            got = got_of(recv_x, count, h)
            outcomes.append(oracle.outcome(got, want[rank], out, want_c[rank]))
            if outcomes[-1] == "failed" and t_failed is None:
                t_failed = t_raised
            break
        torch.cuda.synchronize()
        o = oracle.outcome(got_of(recv_x, count, h), want[rank], out, want_c[rank])
        outcomes.append(o)
        if o == "failed" and t_failed is None:
            t_failed = time.time()
    everyone = [None] * R
    dist.all_gather_object(everyone, (t_fault, t_failed, t_raised), group=group)
    t0 = everyone[late][0]
    print(f"\n[rank {rank}] skip {skip} on {path}, R={R}: outcomes {outcomes}, raised "
          f"{type(raised[1]).__name__ + ' at call ' + str(raised[0]) if raised else 'nothing'}"
          f"; from the fault: failed output after "
          f"{'-' if t_failed is None else f'{t_failed - t0:.3f} s'}, raise after "
          f"{'-' if t_raised is None else f'{t_raised - t0:.3f} s'}"
          + (f": {raised[1]}" if raised else ""))
    b.destroy()
    wrong = [o for o in outcomes if o.startswith("WRONG")]
    assert not wrong, f"rank {rank} took a failed call's outputs for good ones: {wrong}"
    assert outcomes[:2] == ["good", "good"], outcomes
    assert raised is not None, f"rank {rank} never raised: {outcomes}"
    assert outcomes[-1] == "failed" and "failed" not in outcomes[:-1], (
        f"rank {rank}: its first failed call must be followed by a raise: {outcomes}")
    err = raised[1]
    if rank == late:
        assert isinstance(err, ep.PeerError) and err.kind == "PeerFailed", repr(err)
        assert err.peer != late, str(err)
    else:
        assert isinstance(err, (ep.TimeoutError, ep.PeerError)), repr(err)
        assert err.peer == late or err.kind == "PeerFailed", str(err)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("path", ["batched", "per_expert"])
@pytest.mark.parametrize("hooks", [False, True], ids=["fused", "hooks"])
def test_wait_cost_stats_name_the_late_rank(group, R, E, op, path, hooks):
    """The wait-cost stats as DeepEP's engines read them (dispatch_wait_recv_cost_stats,
    combine_wait_recv_cost_stats): the last rank starts the operation 0.2 s late (a host sleep
    before the call); every other rank's entry for it grows by about that wait (SM clock
    cycles), its entries for the ranks on time stay far below it, and the late rank waited for
    nobody that long. A dispatch also adds its counts to cumulative_local_expert_recv_stats, on
    the device."""
    if R == 1:
        pytest.skip("one rank: no peer to be late for")
    import time

    import torch.distributed as dist

    rank, late, delay = group.rank(), R - 1, 0.2
    b = make_buffer(group, R, E, path=path)
    ins = inputs(21 if op == "dispatch" else 22, R, E, n=T)
    want, want_c = expect(ins, E, MODES["bf16"])
    x, topk, w, y = (on_gpu(t) for t in ins[rank])
    # A whole pair first: it forms the group (collectively, on the host) and loads the
    # kernels, and leaves no dispatch due, so the timed call runs on the same set.
    _, _, h0, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    b.low_latency_combine(y, topk, w, h0)
    if op == "combine":
        _, _, h, _, _ = b.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    waits = torch.zeros(R, dtype=torch.int64, device=x.device)
    stats = torch.full((E // R,), 3, dtype=torch.int32, device=x.device)
    if rank == late:
        time.sleep(delay)
    if op == "dispatch":
        recv_x, count, h, _, hook = b.low_latency_dispatch(
            x, topk, T, E, stats, waits, use_fp8=False, return_recv_hook=hooks)
    else:
        out, _, hook = b.low_latency_combine(y, topk, w, h, return_recv_hook=hooks,
                                             combine_wait_recv_cost_stats=waits)
    if hooks:
        hook()
    torch.cuda.synchronize()
    b.check()
    got = waits.cpu().tolist()
    print(f"rank {rank} ({op}, {path}, {'hooks' if hooks else 'fused'}): waits {got} cycles")
    if op == "dispatch":
        diff = oracle.diff(got_of(recv_x, count, h), want[rank])
        added = (stats.cpu() - 3).tolist() == count.cpu().tolist()
    else:
        diff, added = oracle.combine_diff(out, want_c[rank]), True
    dist.barrier(group=group)  # every rank done before any assertion can end its test
    b.destroy()
    assert diff is None
    assert added, "cumulative_local_expert_recv_stats did not get the call's counts"
    floor = int(delay * 0.25 * 1e9)  # a quarter of the delay at 1 GHz: H200 SMs run faster
    if rank != late:
        assert got[late] >= floor, got
        assert all(v * 10 < got[late] for s, v in enumerate(got) if s != late), got
    else:
        assert all(0 <= v < floor for v in got), got
