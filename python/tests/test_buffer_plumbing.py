"""The Buffer's Python plumbing on the CPU: the native GPU rank is replaced by a stand-in that
computes the oracle's outputs on the host and writes them through the very pointers and lengths
the Buffer passes (so tensor allocation, shapes, dtypes, byte counts, the handle, DeepEP's packed
layout_range, hooks, out=, zero_copy and the stats are exercised end to end, two ranks in one
process). It says nothing about the GPU kernels: test_gpu.py does. Needs torch (CPU is enough).

Every test runs on both call paths: 'python' (EP_DISPATCH_TORCH_EXT=0: the stand-in is called
through the native methods' API with the tensors) and 'extension' (the C++ torch extension
allocates the outputs and calls the native `_StandInRank`, whose C ABI entry makes the native
checks and hands the stand-in the checked addresses).
"""

import ctypes

import pytest

import ep_dispatch as ep
from ep_dispatch import _ep_dispatch as native
from ep_dispatch import oracle

torch = pytest.importorskip("torch", reason="torch is not installed (the plumbing tests need it)")
np = pytest.importorskip("numpy", reason="numpy is not installed")


def read(ptr_len, dtype, np_dtype):
    ptr, n = ptr_len
    size = torch.empty(0, dtype=dtype).element_size()
    return np.frombuffer(ctypes.string_at(ptr, n * size), dtype=np_dtype) if n else \
        np.zeros(0, np_dtype)


def write(ptr_len, data, elem):
    ptr, n = ptr_len
    b = data.tobytes()
    assert len(b) <= n * elem, f"{len(b)} bytes into a buffer of {n * elem}"
    ctypes.memmove(ptr, b, len(b))


# The call path of the running test (the `call_path` fixture).
CALL_PATH = {"value": "python"}


@pytest.fixture(autouse=True, params=["python", "extension"])
def call_path(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("EP_DISPATCH_TORCH_EXT", "0")
    else:
        from ep_dispatch import _torch_ext

        monkeypatch.delenv("EP_DISPATCH_TORCH_EXT", raising=False)
        ext = _torch_ext.load(torch)
        if ext is None:
            pytest.skip(f"the C++ torch extension is not available here: "
                        f"{_torch_ext._loaded.get(str(_torch_ext.SOURCE), (None, '?'))[1]}")
    CALL_PATH["value"] = request.param
    yield request.param
    CALL_PATH["value"] = "python"


class World:
    """What the peers would do: collects every rank's call, and when the last rank arrives
    writes each rank's outputs (the oracle's, in the kernels' formats) through its pointers.
    On the extension path each rank is a native `_StandInRank` over its `FakeRank`."""

    def __init__(self, R):
        self.R = R
        self.dispatch_calls, self.combine_calls = {}, {}
        self.created = []
        self.wrap = CALL_PATH["value"] == "extension"

    def rank(self, spec, rank, path, transport, timeout_s, all_gather, trap_on_error=False,
             enable_shrink=False):
        num_ranks, E, T, H, K, use_fp8, round_scale, use_ue8m0, device = spec.shape
        assert num_ranks == self.R and callable(all_gather) and device == -1
        assert trap_on_error in (True, False)
        self.created.append((rank, path, transport, timeout_s))
        fake = FakeRank(self, rank, spec, E, T, H, K,
                        dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0))
        return native._StandInRank(spec, fake) if self.wrap else fake


class FakeRank:
    """The native rank's API over the native tensor checks (`CallSpec`, the very checks the
    native rank makes): what passes is read and written through the checked addresses."""

    def __init__(self, world, rank, spec, E, T, H, K, mode):
        self.w, self.rank, self.spec = world, rank, spec
        self.E, self.T, self.H, self.K, self.mode = E, T, H, K, mode
        self.next_id, self.pending, self.pending_c, self.next_c = 1, None, None, 1
        self.tokens = {}  # dispatch id -> its token count (the native rank keeps it too)
        self.error = None  # what the kernels "recorded": poll() and every call raise it

    def check(self):
        self.poll()

    def poll(self):
        if self.error is not None:
            raise self.error

    def pending_dispatch(self):
        return self.pending

    def pending_combine(self):
        return self.pending_c

    def dispatch_send(self, stream, *tensors):
        return self.dispatch_checked(stream, True, self.spec.check_dispatch(*tensors))

    def dispatch_recv(self, stream, hid):
        if self.pending != hid:
            return False
        self.pending = None
        return True

    def dispatch(self, stream, *tensors):
        return self.dispatch_checked(stream, False, self.spec.check_dispatch(*tensors))

    def dispatch_checked(self, stream, send_only, addrs):
        """A dispatch whose tensors passed the native checks (`addrs`: what
        `CallSpec.check_dispatch` returns)."""
        self.poll()  # the native call's entry check
        n, x, topk, recv_x, scales, count, src, layout, stats, _ = addrs
        L, R, T, H, K = self.E // self.w.R, self.w.R, self.T, self.H, self.K
        # A due receive half is enqueued ahead of a new call (as the native rank does).
        self.pending = None
        # The lengths the device API checks.
        assert x[1] == n * H and topk[1] == n * K
        assert recv_x[1] == L * R * T * H * (1 if self.mode["use_fp8"] else 2)
        if self.mode["use_fp8"]:
            assert scales[1] == L * R * T * H // (512 if self.mode["use_ue8m0"] else 128) * 4
        else:
            assert scales is None
        assert count[1] == L and src[1] == L * R * T and layout[1] == L * R
        self.w.dispatch_calls[self.rank] = (
            read(x, torch.bfloat16, np.uint16).reshape(n, H).copy(),
            read(topk, torch.int64, np.int64).reshape(n, K).copy(),
            (recv_x, scales, count, src, layout, stats))
        if len(self.w.dispatch_calls) == R:
            calls = [self.w.dispatch_calls[r] for r in range(R)]
            self.w.dispatch_calls = {}
            outs = oracle.dispatch([c[0] for c in calls], [c[1] for c in calls], T, self.E,
                                   **self.mode)
            for (_, _, (rx, sc, ct, si, lr, st)), o in zip(calls, outs):
                write(rx, o.recv_x, 1)
                if sc is not None:  # the Buffer's scales are column-major (DeepEP's strides)
                    write(sc, np.ascontiguousarray(o.recv_x_scales.transpose(0, 2, 1)), 1)
                write(ct, o.recv_count, 4)
                if st is not None:  # the kernels add the counts to the caller's stats
                    write(st, read(st, torch.int32, np.int32) + o.recv_count.astype(np.int32), 4)
                write(si, o.src_info, 4)
                begin, cnt = o.layout_pairs()
                write(lr, np.stack([begin, cnt], axis=-1).astype(np.int32), 8)  # (begin, count)
        hid, self.next_id = self.next_id, self.next_id + 1
        self.tokens[hid] = n
        if send_only:
            self.pending = hid
        return hid

    def dispatched_tokens(self, handle):
        return self.tokens[handle]

    def combine_send(self, stream, handle, y, topk, w, out, wait_stats=None, keep=None,
                     use_logfmt=False):
        addrs = self.spec.check_combine(self.tokens[handle], y, topk, w, out, wait_stats,
                                        use_logfmt)
        return self.combine_checked(stream, handle, True, addrs, use_logfmt)

    def combine_recv(self, stream, cid):
        if self.pending_c != cid:
            return False
        self.pending_c = None
        return True

    def combine(self, stream, handle, y, topk, w, out, wait_stats=None, use_logfmt=False):
        addrs = self.spec.check_combine(self.tokens[handle], y, topk, w, out, wait_stats,
                                        use_logfmt)
        return self.combine_checked(stream, handle, False, addrs, use_logfmt)

    def combine_checked(self, stream, handle, send_only, addrs, use_logfmt):
        """A combine whose tensors passed the native checks (`addrs`: what
        `CallSpec.check_combine` returns)."""
        self.poll()  # the native call's entry check
        self.pending_c = None  # a due receive half goes first (as in dispatch)
        n = self.tokens[handle]
        y, topk, w, out, _ = addrs
        L, R, T, H, K = self.E // self.w.R, self.w.R, self.T, self.H, self.K
        assert y[1] == L * R * T * H and topk[1] == n * K and w[1] == topk[1]
        assert out[1] == n * H
        self.w.combine_calls[self.rank] = (
            read(y, torch.bfloat16, np.uint16).reshape(L, R * T, H).copy(),
            read(topk, torch.int64, np.int64).reshape(n, K).copy(),
            read(w, torch.float32, np.float32).reshape(n, K).copy(), out, use_logfmt)
        if len(self.w.combine_calls) == R:
            calls = [self.w.combine_calls[r] for r in range(R)]
            self.w.combine_calls = {}
            # What the peers would do: the format the calls asked for (the same on every rank).
            assert len({c[4] for c in calls}) == 1, "the ranks' use_logfmt differ"
            outs = oracle.combine([c[0] for c in calls], [c[1] for c in calls],
                                  [c[2] for c in calls], T, self.E, use_logfmt=calls[0][4])
            for c, o in zip(calls, outs):
                write(c[3], o, 2)
        cid, self.next_c = self.next_c, self.next_c + 1
        if send_only:
            self.pending_c = cid
        return cid


class Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


T, H, K = 6, 512, 3
R, E = 2, 8


def make_buffers(monkeypatch, **kw):
    world = World(R)
    probed = []
    monkeypatch.setattr(native, "probe_devices", lambda n: 1)
    monkeypatch.setattr(native, "probe_transport", probed.append)
    monkeypatch.setattr(native, "GpuRank", world.rank)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bufs = []
    for r in range(R):
        b = ep.Buffer(Group(r, R), 0, 1 << 20, True, E // R, timeout_s=3, **kw)
        b._dev = torch.device("cpu")  # the stand-in "device" is the host
        b._dev_index = -1  # (what the native checks want of `get_device()` there)
        b._stream = lambda: 0
        assert b.call_path == CALL_PATH["value"]
        bufs.append(b)
    world.probed = probed
    return world, bufs


@pytest.fixture
def buffers(monkeypatch):
    return make_buffers(monkeypatch, path="per_expert")


def make_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(R):
        n = [T, 2][r]
        x = (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)
        topk = torch.rand(n, E, generator=g).argsort(dim=1)[:, :K].to(torch.int64).contiguous()
        topk[0, 1] = -1
        w = torch.randn(n, K, generator=g)
        y = torch.randn(E // R, R * T, H, generator=g).to(torch.bfloat16)
        out.append((x, topk, w, y))
    return out


def got_of(recv_x, recv_count, handle):
    x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    return type("Got", (), dict(recv_x=x, recv_x_scales=scales, recv_count=recv_count,
                                layout_range=handle.layout_range, src_info=handle.src_info))


@pytest.mark.parametrize("mode", [dict(use_fp8=False), dict(use_fp8=True),
                                  dict(use_fp8=True, round_scale=True, use_ue8m0=True)],
                         ids=["bf16", "fp8", "ue8m0"])
def test_dispatch_and_combine_through_the_buffer(buffers, mode):
    world, bufs = buffers
    ins = make_inputs(1)
    want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E, **mode)
    want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    res = [b.low_latency_dispatch(i[0], i[1], T, E, **mode) for b, i in zip(bufs, ins)]
    assert [c[1:] for c in world.created] == [("per_expert", "auto", 3.0)] * R
    for r, (recv_x, recv_count, handle, event, hook) in enumerate(res):
        assert event.event is None and hook is None
        if mode["use_fp8"]:
            assert recv_x[0].dtype == torch.float8_e4m3fn
            assert recv_x[1].dtype == (torch.int32 if mode.get("use_ue8m0") else torch.float32)
            # DeepEP's strides: column-major in the last two dims (DeepGEMM asserts it).
            G, RT = H // (512 if mode.get("use_ue8m0") else 128), R * T
            assert recv_x[1].shape == (E // R, RT, G)
            assert recv_x[1].stride() == (RT * G, 1, RT)
            assert recv_x[0].shape == (E // R, RT, H) and recv_x[0].stride() == (RT * H, H, 1)
        else:
            assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (E // R, R * T, H)
        # DeepEP's handle: a 5-tuple whose layout_range packs (begin << 32) | count.
        src_info, layout_range, t, h, e = handle
        assert (t, h, e) == (T, H, E) and layout_range.dtype == torch.int64
        assert layout_range.tolist() == want[r].layout_range.tolist()
        begin, count = handle.layout_pairs()
        assert count.tolist() == (want[r].layout_range & 0xFFFFFFFF).tolist()
        assert oracle.diff(got_of(recv_x, recv_count, handle), want[r]) is None
    outs = [b.low_latency_combine(i[3], i[1], i[2], rr[2]) for b, i, rr in zip(bufs, ins, res)]
    for r, (combined, event, hook) in enumerate(outs):
        assert combined.shape == (ins[r][0].shape[0], H) and hook is None
        assert oracle.combine_diff(combined, want_c[r]) is None


def test_use_logfmt_reaches_the_native_call_and_differs_from_bf16(buffers):
    """use_logfmt=True travels to the native combine (whole and hook), which combines in
    LogFMT: the oracle's LogFMT combine, which differs from the bf16 one for these inputs."""
    world, bufs = buffers
    ins = make_inputs(3)
    ins = [(x, t, w, (y.float() * 0.0625).to(torch.bfloat16)) for x, t, w, y in ins]
    args = ([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    want_lf = oracle.combine(*args, use_logfmt=True)
    want_bf = oracle.combine(*args)
    assert any(oracle.combine_diff(a, b) is not None for a, b in zip(want_lf, want_bf))
    for hook in (False, True):
        res = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
        outs = [b.low_latency_combine(i[3], i[1], i[2], rr[2], use_logfmt=True,
                                      return_recv_hook=hook)
                for b, i, rr in zip(bufs, ins, res)]
        for r, (combined, _, h) in enumerate(outs):
            if hook:
                h()
            assert oracle.combine_diff(combined, want_lf[r]) is None, f"rank {r} hook {hook}"
    with pytest.raises(ep.ArgumentError) as e:
        bufs[0].low_latency_combine(ins[0][3], ins[0][1], ins[0][2], res[0][2], use_logfmt=1)
    assert e.value.argument == "use_logfmt"



def test_hooks_out_stats_and_zero_copy(buffers):
    world, bufs = buffers
    ins = make_inputs(2)
    want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E)
    want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    stats = [torch.full((E // R,), 7, dtype=torch.int32) for _ in range(R)]
    res = [b.low_latency_dispatch(i[0], i[1], T, E, st, return_recv_hook=True)
           for b, i, st in zip(bufs, ins, stats)]
    assert all(callable(rr[4]) for rr in res)
    for r, (recv_x, recv_count, handle, _, hook) in enumerate(res):
        hook()
        assert (stats[r] - 7).tolist() == want[r].recv_count.tolist()
        assert oracle.diff(got_of(recv_x, recv_count, handle), want[r]) is None
    outs = []
    for b, i, rr in zip(bufs, ins, res):
        z = b.get_next_low_latency_combine_buffer(rr[2])
        z.copy_(i[3])
        out = torch.empty(i[0].shape[0], H, dtype=torch.bfloat16)
        got, _, hook = b.low_latency_combine(torch.zeros_like(i[3]), i[1], i[2], rr[2],
                                             zero_copy=True, out=out, return_recv_hook=True)
        assert got is out and callable(hook)
        outs.append((got, hook))
    for r, (got, hook) in enumerate(outs):
        hook()
        assert oracle.combine_diff(got, want_c[r]) is None


def test_handles_are_checked(buffers):
    _, bufs = buffers
    ins = make_inputs(3)
    res = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    x, topk, w, y = ins[0]
    with pytest.raises(ep.InputError, match="not a handle returned by this Buffer"):
        bufs[0].low_latency_combine(y, topk, w, res[1][2])  # rank 1's handle
    with pytest.raises(ep.InputError, match="not a handle returned by this Buffer"):
        bufs[0].low_latency_combine(y, topk, w, tuple(res[0][2]))
    with pytest.raises(ep.ArgumentError) as e:
        bufs[0].low_latency_combine(y, topk, w.double(), res[0][2])
    assert e.value.argument == "topk_weights"
    with pytest.raises(ep.ArgumentError) as e:  # the shape is fixed by the first dispatch
        bufs[0].low_latency_dispatch(x, topk, T + 1, E)
    assert e.value.argument == "num_max_dispatch_tokens_per_rank"
    bufs[0].destroy()
    with pytest.raises(ep.InputError, match="destroyed"):
        bufs[0].low_latency_combine(y, topk, w, res[0][2])


@pytest.mark.parametrize("name", ["use_fp8", "round_scale", "use_ue8m0", "async_finish",
                                  "return_recv_hook"])
def test_a_flag_that_is_no_bool_is_named_before_any_call(buffers, name):
    """Each dispatch flag is checked before the call path is chosen: a non-bool is an
    ArgumentError naming it, on both paths, and the Buffer stays usable."""
    _, bufs = buffers
    ins = make_inputs(4)
    x, topk, _, _ = ins[0]
    with pytest.raises(ep.ArgumentError) as e:
        bufs[0].low_latency_dispatch(x, topk, T, E, **{name: 1})
    assert e.value.argument == name and "is not a bool" in str(e.value), str(e.value)
    # Held until every rank has called: the stand-in peers write each rank's outputs then.
    res = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    # Every selection of every rank arrives once: the ranks' recv_counts add up to them.
    assert sum(int(r[1].sum()) for r in res) == sum(int((i[1] != -1).sum()) for i in ins)


@pytest.mark.parametrize("transport", ["nccl", "two-tier"])
def test_the_transport_reaches_the_native_rank(monkeypatch, transport):
    world, bufs = make_buffers(monkeypatch, transport=transport)
    assert world.probed == [transport] * R  # each rank probed what the transport needs
    ins = make_inputs(4)
    want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E)
    want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T, E)
    res = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    assert [c[1:] for c in world.created] == [("batched", transport, 3.0)] * R
    for r, (recv_x, recv_count, handle, _, _) in enumerate(res):
        assert handle.path == "batched"
        assert oracle.diff(got_of(recv_x, recv_count, handle), want[r]) is None
    outs = [b.low_latency_combine(i[3], i[1], i[2], rr[2]) for b, i, rr in zip(bufs, ins, res)]
    for r, (combined, _, _) in enumerate(outs):
        assert oracle.combine_diff(combined, want_c[r]) is None


@pytest.mark.parametrize("transport", ["nccl", "two-tier"])
def test_per_expert_over_nccl_never_reaches_the_native_rank(monkeypatch, transport):
    world = World(R)
    monkeypatch.setattr(native, "probe_devices", lambda n: 1)
    monkeypatch.setattr(native, "GpuRank", world.rank)
    with pytest.raises(ep.UnsupportedError, match="exact sizes"):
        ep.Buffer(Group(0, R), path="per_expert", transport=transport)
    assert world.created == []


def test_two_dispatches_in_flight(buffers):
    """dispatch A and dispatch B with hooks, hook A, hook B, combine A,
    combine B (with a copy of topk_idx at another address, as vLLM's EPLB passes): B runs on a
    second buffer set (formed at its first use), every output equals the oracle, and a later
    dispatch goes back to the first set (A was combined) without forming a third."""
    world, bufs = buffers
    ins_a, ins_b = make_inputs(4), make_inputs(5)

    def want(ins):
        return (oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T, E),
                oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                               T, E))

    (wa, wca), (wb, wcb) = want(ins_a), want(ins_b)
    ra = [b.low_latency_dispatch(i[0], i[1], T, E, return_recv_hook=True)
          for b, i in zip(bufs, ins_a)]
    assert len(world.created) == R
    rb = [b.low_latency_dispatch(i[0], i[1], T, E, return_recv_hook=True)
          for b, i in zip(bufs, ins_b)]
    assert len(world.created) == 2 * R, "B needs a second buffer set"
    for rr in ra + rb:
        rr[4]()
    for r in range(R):
        assert oracle.diff(got_of(ra[r][0], ra[r][1], ra[r][2]), wa[r]) is None
        assert oracle.diff(got_of(rb[r][0], rb[r][1], rb[r][2]), wb[r]) is None
    ca = [b.low_latency_combine(i[3], i[1].clone(), i[2], rr[2])[0]
          for b, i, rr in zip(bufs, ins_a, ra)]
    cb = [b.low_latency_combine(i[3], i[1], i[2], rr[2])[0] for b, i, rr in zip(bufs, ins_b, rb)]
    for r in range(R):
        assert oracle.combine_diff(ca[r], wca[r]) is None
        assert oracle.combine_diff(cb[r], wcb[r]) is None
    # (The results are kept: the stand-in world writes rank 0's outputs when rank 1 calls.)
    rc = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, make_inputs(6))]
    assert len(rc) == R and len(world.created) == 2 * R, "the first set was free again"


def test_an_error_of_one_buffer_set_raises_at_a_call_on_the_other(buffers):
    """Never silent: with two dispatches in flight each buffer set is a group with
    its own error words. An error set 0 recorded must raise at the next call whichever set or
    mode it uses: a third dispatch, a dispatch in another mode (before it forms a group) and
    the combine of set 1's handle all raise it, and nothing new is formed."""
    world, bufs = buffers
    ins = make_inputs(7)
    ra = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    rb = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    assert len(world.created) == 2 * R
    set0 = next(g for k, g in bufs[0]._ranks.items() if k[1] == 0)
    lost = ep.TimeoutError("rank 0 timed out waiting for rank 1 in dispatch/recv (call 1)")
    getattr(set0, "target", set0).error = lost  # the FakeRank (under a _StandInRank)
    b, i = bufs[0], ins[0]
    with pytest.raises(ep.TimeoutError):
        b.low_latency_combine(i[3], i[1], i[2], rb[0][2])  # set 1's handle
    with pytest.raises(ep.TimeoutError):
        b.low_latency_dispatch(i[0], i[1], T, E)
    with pytest.raises(ep.TimeoutError):
        b.low_latency_dispatch(i[0], i[1], T, E, use_fp8=False)  # another mode: no group formed
    assert len(world.created) == 2 * R
    assert ra[0][2]._key[1] == 0 and rb[0][2]._key[1] == 1


def test_a_buffer_collected_during_capture_releases_its_groups_later(monkeypatch):
    """A Buffer freed while a CUDA graph is being captured (e.g. by the cyclic collector) must
    not release its groups then (their drop synchronises and frees, which invalidates the
    capture): they wait for the next call made outside capture."""
    import gc

    from ep_dispatch import buffer as bufmod

    world, bufs = make_buffers(monkeypatch)
    ins = make_inputs(7)
    res = [b.low_latency_dispatch(i[0], i[1], T, E) for b, i in zip(bufs, ins)]
    gc.collect()  # other tests' garbage Buffers go now, not inside the "capture" below
    bufmod._DEFERRED.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    victim = bufs.pop()
    victim.self_cycle = victim  # freed by the cyclic collector, as in a test fixture's closure
    del victim
    gc.collect()
    assert len(bufmod._DEFERRED) == 1, "the group waits"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    bufs[0]._rank_group(T, H, E, K, True, False, False)
    assert bufmod._DEFERRED == [], "released by the next call outside capture"
    assert len(res) == R


def test_a_64_rank_group_through_the_buffer(monkeypatch):
    """64 ranks (past the kernels' old limit of 32) through the Buffer's plumbing: every rank's
    tensors, shapes and byte counts for R = 64, dispatch and combine equal to the oracle."""
    R64, E64, T64, H64, K64 = 64, 128, 2, 128, 2
    world = World(R64)
    monkeypatch.setattr(native, "probe_devices", lambda n: 1)
    monkeypatch.setattr(native, "probe_transport", lambda t: None)
    monkeypatch.setattr(native, "GpuRank", world.rank)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bufs = []
    for r in range(R64):
        b = ep.Buffer(Group(r, R64), 0, 1 << 20, True, E64 // R64, timeout_s=3)
        b._dev = torch.device("cpu")
        b._dev_index = -1
        b._stream = lambda: 0
        assert b.call_path == CALL_PATH["value"]
        bufs.append(b)
    g = torch.Generator().manual_seed(64)
    ins = []
    for r in range(R64):
        n = r % (T64 + 1)
        x = (torch.randn(n, H64, generator=g) * 3).to(torch.bfloat16)
        topk = torch.rand(n, E64, generator=g).argsort(dim=1)[:, :K64].to(torch.int64).contiguous()
        w = torch.randn(n, K64, generator=g)
        y = torch.randn(E64 // R64, R64 * T64, H64, generator=g).to(torch.bfloat16)
        ins.append((x, topk, w, y))
    want = oracle.dispatch([i[0] for i in ins], [i[1] for i in ins], T64, E64, use_fp8=False)
    got = [b.low_latency_dispatch(i[0], i[1], T64, E64, use_fp8=False)
           for b, i in zip(bufs, ins)]
    for r, (recv_x, recv_count, handle, _, _) in enumerate(got):
        assert recv_x.shape == (E64 // R64, R64 * T64, H64)
        assert handle.layout_range.shape == (E64 // R64, R64)
        assert oracle.diff(got_of(recv_x, recv_count, handle), want[r]) is None, r
    want_c = oracle.combine([i[3] for i in ins], [i[1] for i in ins], [i[2] for i in ins], T64,
                            E64)
    outs = [b.low_latency_combine(i[3], i[1], i[2], h[2])
            for b, i, h in zip(bufs, ins, got)]
    for r, (combined, _, _) in enumerate(outs):
        assert oracle.combine_diff(combined, want_c[r]) is None, r
