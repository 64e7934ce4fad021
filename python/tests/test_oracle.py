"""The oracle through Python: hand-checked cases, an independent numpy model of the layout, the
CPU paths (per-expert and batched, Rust) against it, and the typed errors. CPU only."""

import struct

import numpy as np
import pytest

import ep_dispatch as ep
from ep_dispatch import oracle


def bf16(values, shape=None):
    """bf16 bits of float32 values (rounded by the contract's rounding)."""
    a = np.asarray(values, dtype=np.float32)
    if shape is not None:
        a = np.broadcast_to(a, shape).copy()
    return oracle.bf16_from_f32(a)


def random_case(rng, R, E, T, H, K, masked=0.2):
    """Every rank's x (bf16 bits), topk_idx (distinct experts, some -1) and token count."""
    xs, ts = [], []
    for _ in range(R):
        n = int(rng.integers(0, T + 1))
        xs.append(bf16(rng.standard_normal((n, H)).astype(np.float32) * 3))
        t = np.stack([rng.permutation(E)[:K] for _ in range(n)]) if n else np.zeros((0, K))
        t = t.astype(np.int64)
        t[rng.random(t.shape) < masked] = -1
        ts.append(t)
    return xs, ts


# ---- hand-checked ---------------------------------------------------------------------------

def test_hand_checked_bf16_dispatch_and_combine():
    # R=2, E=4 (L=2 per rank), T=2, H=128, K=2.
    # Rank 0: token 0 -> experts 1 and 2; token 1 -> expert 1. Rank 1: token 0 -> expert 3.
    xs = [np.concatenate([bf16(1.0, (1, 128)), bf16(2.0, (1, 128))]), bf16(3.0, (1, 128))]
    ts = [np.array([[1, 2], [1, -1]]), np.array([[3, -1]])]
    r0, r1 = oracle.dispatch(xs, ts, 2, 4, use_fp8=False)
    # Rank 0 hosts experts 0, 1: expert 1 got rank 0's tokens 0 and 1, in token order.
    assert r0.recv_count.tolist() == [0, 2]
    begin, count = r0.layout_pairs()
    assert begin.tolist() == [[0, 0], [0, 2]] and count.tolist() == [[0, 0], [2, 0]]
    assert r0.layout_range.tolist() == [[0, 0], [2, 2 << 32]]
    assert r0.src_info[1, :2].tolist() == [0, 1]
    assert (r0.recv_x[1, 0] == 0x3F80).all() and (r0.recv_x[1, 1] == 0x4000).all()
    assert r0.recv_x.dtype == np.uint16 and r0.recv_x.shape == (2, 4, 128)
    assert r0.recv_x_scales is None
    # Rank 1 hosts experts 2, 3: one row each, from rank 0 (token 0) and rank 1 (token 0).
    assert r1.recv_count.tolist() == [1, 1]
    assert r1.layout_range.tolist() == [[1, 1 << 32], [0, 1]]
    assert r1.src_info[:, 0].tolist() == [0, 0]
    assert (r1.recv_x[0, 0] == 0x3F80).all() and (r1.recv_x[1, 0] == 0x4040).all()

    # Combine: every expert row holds the constant 2^e (e = global expert), weights are powers
    # of two, so each sum is exact: rank 0 token 0 = 0.5*2 + 0.25*4 = 2, token 1 = 0.5*2 = 1;
    # rank 1 token 0 = 2*8 = 16.
    ys = [np.stack([bf16(1.0, (4, 128)), bf16(2.0, (4, 128))]),
          np.stack([bf16(4.0, (4, 128)), bf16(8.0, (4, 128))])]
    ws = [np.array([[0.5, 0.25], [0.5, 7.0]], np.float32), np.array([[2.0, 5.0]], np.float32)]
    c0, c1 = oracle.combine(ys, ts, ws, 2, 4)
    assert c0.shape == (2, 128) and c1.shape == (1, 128)
    assert (c0[0] == 0x4000).all() and (c0[1] == 0x3F80).all() and (c1[0] == 0x4180).all()


def test_logfmt_combine_is_exact_on_raw_groups_and_close_on_packed_ones():
    """use_logfmt=True: groups that do not pack (|y| >= 1) travel as bf16, so the combine is
    the bf16 one's bits; packed groups (|y| < 1) decode within LogFMT's bound (2.2% at the
    widest grid, docs/contract.md 4.1), so it differs from bf16 but stays close. H % 128 != 0
    is the config error."""
    rng = np.random.default_rng(32)
    R, E, T, H, K = 2, 4, 5, 256, 2
    _, ts = random_case(rng, R, E, T, H, K, masked=0.0)
    L = E // R
    big = [bf16(1.0 + rng.random((L, R * T, H)).astype(np.float32)) for _ in range(R)]
    ws = [np.full(t.shape, 0.5, np.float32) for t in ts]
    raw = oracle.combine(big, ts, ws, T, E, use_logfmt=True)
    exact = oracle.combine(big, ts, ws, T, E)
    for r in range(R):
        assert oracle.combine_diff(raw[r], exact[r]) is None, r
    small = [bf16(0.5 * rng.random((L, R * T, H)).astype(np.float32) + 0.01) for _ in range(R)]
    lf = oracle.combine(small, ts, ws, T, E, use_logfmt=True)
    bf = oracle.combine(small, ts, ws, T, E)
    assert any(oracle.combine_diff(a, b) is not None for a, b in zip(lf, bf))
    for a, b in zip(lf, bf):
        fa, fb = oracle.f32_from_bf16(a), oracle.f32_from_bf16(b)
        assert np.all(np.abs(fa - fb) <= 0.03 * np.abs(fb) + 1e-6)
    with pytest.raises(ep.ConfigError) as e:
        oracle.combine([y[..., :192] for y in small], ts, ws, T, E, use_logfmt=True)
    assert e.value.kind == "HiddenNotMultiple"
    with pytest.raises(ep.ArgumentError):
        oracle.combine(small, ts, ws, T, E, use_logfmt="yes")


def test_outcome_tells_good_from_failed_from_wrong():
    """oracle.outcome: the oracle's outputs are good; a dispatch that received nothing and a
    combine of NaN rows are the failed outputs (either alone, or both); a finite wrong row, or
    a failed dispatch beside a finite wrong combine, is WRONG."""
    import copy

    xs = [np.concatenate([bf16(1.0, (1, 128)), bf16(2.0, (1, 128))]), bf16(3.0, (1, 128))]
    ts = [np.array([[1, 2], [1, -1]]), np.array([[3, -1]])]
    d0, _ = oracle.dispatch(xs, ts, 2, 4, use_fp8=False)
    ys = [np.stack([bf16(1.0, (4, 128)), bf16(2.0, (4, 128))]),
          np.stack([bf16(4.0, (4, 128)), bf16(8.0, (4, 128))])]
    ws = [np.array([[0.5, 0.25], [0.5, 7.0]], np.float32), np.array([[2.0, 5.0]], np.float32)]
    c0, _ = oracle.combine(ys, ts, ws, 2, 4)
    failed_d = copy.deepcopy(d0)
    failed_d.recv_count = np.zeros_like(d0.recv_count)
    failed_d.layout_range = np.zeros_like(d0.layout_range)
    nan = np.full_like(c0, 0x7FFF)
    wrong = c0.copy()
    wrong[1, 5] = 0x4000
    assert oracle.outcome(d0, d0, c0, c0) == "good"
    assert oracle.outcome(failed_d, d0, nan, c0) == "failed"
    assert oracle.outcome(d0, d0, nan, c0) == "failed"
    assert oracle.outcome(failed_d, d0, c0, c0) == "failed"
    assert oracle.outcome(d0, d0, wrong, c0).startswith("WRONG")
    assert oracle.outcome(failed_d, d0, wrong, c0).startswith("WRONG")
    half_nan = nan.copy()
    half_nan[0] = c0[0]
    assert oracle.outcome(d0, d0, half_nan, c0).startswith("WRONG")


def test_hand_checked_fp8_scales():
    # One token of 512 ones, to expert 0 of a single rank (R=1, E=1, T=1, H=512, K=1).
    x = [bf16(1.0, (1, 512))]
    t = [np.array([[0]])]
    plain, = oracle.dispatch(x, t, 1, 1)
    # amax = 1: scale_inv = 1/448 (f32), q = e4m3(1 * 448) = 0x7E (448 = 1.75 * 2^8).
    assert plain.recv_x.dtype == np.uint8 and (plain.recv_x[0, 0] == 0x7E).all()
    assert plain.recv_x_scales.shape == (1, 1, 4) and plain.recv_x_scales.dtype == np.float32
    want = struct.unpack("<f", struct.pack("<f", 1.0 / 448.0))[0]
    assert plain.recv_x_scales[0, 0].tolist() == [want] * 4
    # round_scale: scale_inv = 2^ceil(log2(1/448)) = 2^-8, q = e4m3(256) = 0x78.
    rnd, = oracle.dispatch(x, t, 1, 1, round_scale=True)
    assert (rnd.recv_x[0, 0] == 0x78).all() and rnd.recv_x_scales[0, 0].tolist() == [2.0**-8] * 4
    # UE8M0: the exponent byte of 2^-8 is 127 - 8 = 0x77, four of them packed in one int32.
    ue, = oracle.dispatch(x, t, 1, 1, round_scale=True, use_ue8m0=True)
    assert ue.recv_x_scales.dtype == np.int32 and ue.recv_x_scales.shape == (1, 1, 1)
    assert ue.recv_x_scales[0, 0, 0] == 0x77777777


def test_bf16_rounding_is_the_contracts():
    # 1 + 2^-8 is a tie: to even (0x3F80); 1 + 3*2^-8 ties up to 0x3F82; NaN is canonical.
    got = oracle.bf16_from_f32(np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan, -0.0], np.float32))
    assert got.tolist() == [0x3F80, 0x3F82, 0x7FFF, 0x8000]
    back = oracle.f32_from_bf16(np.array([0x3F80, 0xC000], np.uint16))
    assert back.tolist() == [1.0, -2.0]
    # Bytes in, bytes out.
    assert oracle.bf16_from_f32(struct.pack("<f", 2.0)) == b"\x00\x40"


# ---- an independent model of the layout -----------------------------------------------------

def layout_model(ts, R, E, T):
    """recv_count, (begin, count) and src_info of every rank, from the contract's words."""
    L = E // R
    out = []
    for d in range(R):
        count = np.zeros((L, R), np.int64)
        src = [[] for _ in range(L)]
        for s in range(R):  # source rank ascending, then token ascending
            for tok, row in enumerate(ts[s]):
                for e in row:
                    if e >= 0 and e // L == d:
                        count[e % L, s] += 1
                        src[e % L].append(tok)
        begin = np.cumsum(count, axis=1) - count
        out.append((count.sum(axis=1), begin, count, src))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_layout_matches_an_independent_model(seed):
    rng = np.random.default_rng(seed)
    R, E, T, H, K = 3, 12, 5, 128, 3
    xs, ts = random_case(rng, R, E, T, H, K)
    outs = oracle.dispatch(xs, ts, T, E, use_fp8=False)
    for d, (got, (recv, begin, count, src)) in enumerate(zip(outs, layout_model(ts, R, E, T))):
        assert got.recv_count.tolist() == recv.tolist(), d
        b, c = got.layout_pairs()
        assert b.tolist() == begin.tolist() and c.tolist() == count.tolist(), d
        for l in range(E // R):
            n = int(recv[l])
            assert got.src_info[l, :n].tolist() == src[l], (d, l)
            # BF16 rows are the source rows, bit for bit.
            rows = []
            for s in range(R):
                for tok, row in enumerate(ts[s]):
                    if d * (E // R) + l in row.tolist():
                        rows.append(xs[s][tok])
            assert np.array_equal(got.recv_x[l, :n], np.array(rows).reshape(n, H)), (d, l)


# ---- the CPU paths against the oracle -------------------------------------------------------

MODES = [
    dict(use_fp8=False),
    dict(use_fp8=True),
    dict(use_fp8=True, round_scale=True),
    dict(use_fp8=True, round_scale=True, use_ue8m0=True),
]


@pytest.mark.parametrize("path", ["per_expert", "batched"])
@pytest.mark.parametrize("mode", MODES, ids=["bf16", "fp8", "fp8-round", "fp8-ue8m0"])
def test_cpu_paths_match_the_oracle_bit_for_bit(path, mode):
    rng = np.random.default_rng(7)
    R, E, T, H, K = 4, 16, 6, 512, 4
    xs, ts = random_case(rng, R, E, T, H, K)
    L = E // R
    ys = [bf16(rng.standard_normal((L, R * T, H)).astype(np.float32)) for _ in range(R)]
    ws = [rng.standard_normal(t.shape).astype(np.float32) for t in ts]
    want = oracle.dispatch(xs, ts, T, E, **mode)
    want_c = oracle.combine(ys, ts, ws, T, E)
    got, got_c = oracle.cpu_roundtrip(path, xs, ts, ys, ws, T, E, **mode)
    for r in range(R):
        assert oracle.diff(got[r], want[r]) is None, r
        assert oracle.combine_diff(got_c[r], want_c[r]) is None, r
    # The comparison can fail: one flipped bit in a valid row is found.
    l = int(np.argmax(want[0].recv_count))
    if want[0].recv_count[l] > 0:
        bad = got[0]
        bad.recv_x = bad.recv_x.copy()
        bad.recv_x[l, 0, 0] ^= 1
        assert oracle.diff(bad, want[0]) == f"recv_x differs at expert {l} row 0"


def test_diff_ignores_rows_past_recv_count():
    xs, ts = [bf16(1.0, (1, 128))], [np.array([[0]])]
    want, = oracle.dispatch(xs, ts, 4, 1, use_fp8=False)
    got, = oracle.dispatch(xs, ts, 4, 1, use_fp8=False)
    got.recv_x = got.recv_x.copy()
    got.recv_x[0, 3] = 0x1234  # past recv_count = 1
    assert oracle.diff(got, want) is None
    got.src_info = got.src_info.copy()
    got.src_info[0, 0] = 9
    assert oracle.diff(got, want) == "src_info[0][0]: 9 vs 0"


def test_bytes_inputs_give_the_same_outputs():
    rng = np.random.default_rng(5)
    xs, ts = random_case(rng, 2, 4, 3, 128, 2, masked=0.0)
    a = oracle.dispatch(xs, ts, 3, 4)
    b = oracle.dispatch([x.tobytes() for x in xs], [t.tobytes() for t in ts], 3, 4,
                        hidden=128, top_k=2)
    for r in range(2):
        assert oracle.diff(a[r], b[r]) is None


# ---- errors ---------------------------------------------------------------------------------

def test_config_errors_are_typed_and_carry_fields():
    with pytest.raises(ep.ConfigError) as e:
        ep.validate_config(3, 256, 128, 7168, 8)
    assert str(e.value) == "config: num_experts = 256 is not a multiple of num_ranks = 3"
    assert e.value.kind == "ExpertsNotDivisible" and (e.value.experts, e.value.ranks) == (256, 3)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ep.EpError)
    with pytest.raises(ep.ConfigError, match=r"hidden = 100 is not a multiple of 128 \(fp8\)"):
        ep.validate_config(1, 1, 1, 100, 1)
    ep.validate_config(1, 1, 1, 100, 1, use_fp8=False)  # BF16 has no such rule
    with pytest.raises(ep.ConfigError, match="UE8M0 scales require round_scale") as e:
        ep.validate_config(1, 1, 1, 512, 1, True, False, True)
    assert e.value.kind == "Ue8m0WithoutRoundScale"
    with pytest.raises(ep.ConfigError, match=r"top_k = 17 is outside 1..=16"):
        ep.validate_config(1, 1, 1, 128, 17)
    with pytest.raises(ep.ConfigError, match="max_tokens_per_rank must be at least 1"):
        oracle.dispatch([bf16(1.0, (1, 128))], [np.array([[0]])], 0, 1)


def test_input_errors_name_rank_token_and_slot():
    x = [bf16(1.0, (2, 128)), bf16(1.0, (1, 128))]
    with pytest.raises(ep.InputError) as e:
        oracle.dispatch(x, [np.array([[0, 1], [2, 9]]), np.array([[0, 1]])], 2, 4)
    v = e.value
    assert v.kind == "ExpertOutOfRange"
    assert (v.rank, v.token, v.slot, v.expert, v.num_experts) == (0, 1, 1, 9, 4)
    assert str(v) == "rank 0: topk_idx[1][1] = 9 is outside [-1, 4)"
    with pytest.raises(ep.InputError, match="rank 1: token 0 selects expert 3 twice"):
        oracle.dispatch(x, [np.array([[0, 1], [2, 3]]), np.array([[3, 3]])], 2, 4)
    with pytest.raises(ep.InputError, match="rank 0: 2 tokens exceed") as e:
        oracle.dispatch(x, [np.array([[0, 1], [2, 3]]), np.array([[0, 1]])], 1, 4)
    assert e.value.kind == "TooManyTokens" and e.value.max == 1


def test_argument_errors_name_the_argument():
    with pytest.raises(ep.ArgumentError) as e:
        oracle.dispatch([np.ones((1, 128))], [np.array([[0]])], 1, 1)
    assert e.value.argument == "x[0]" and "dtype float64" in str(e.value)
    with pytest.raises(ep.ArgumentError) as e:
        oracle.dispatch([b"\x00" * 256], [np.array([[0]])], 1, 1)
    assert e.value.argument == "hidden" and "needed when x is given as bytes" in str(e.value)
    with pytest.raises(ep.ArgumentError) as e:
        oracle.dispatch([b"\x00" * 255], [b"\x00" * 8], 1, 1, hidden=128, top_k=1)
    assert e.value.argument == "x[0]"
    with pytest.raises(ep.ArgumentError) as e:
        oracle.cpu_roundtrip("fast", [bf16(1.0, (1, 128))], [np.array([[0]])],
                             [bf16(0.0, (1, 1, 128))], [np.ones((1, 1), np.float32)], 1, 1)
    assert e.value.argument == "path" and isinstance(e.value, ValueError)
    with pytest.raises(ep.ArgumentError) as e:
        oracle.dispatch([bf16(1.0, (1, 128))], [np.array([[0]])], -1, 1)
    assert e.value.argument == "num_max_dispatch_tokens_per_rank"


@pytest.mark.parametrize("kind, cls, fields", [
    ("Timeout", ep.TimeoutError,
     dict(rank=1, peer=3, phase="combine/recv", call=7, waited_ms=2000)),
    ("GpuTimeout", ep.TimeoutError, dict(rank=0, peer=1, phase="combine/recv", call=2)),
    ("PeerMismatch", ep.PeerError, dict(rank=0, peer=2, call=4, expected=5, got=6)),
    ("OutOfMemory", ep.OutOfMemoryError, dict(needed=1 << 40, available=1 << 30)),
    ("HandleMismatch", ep.InputError, dict(rank=0)),
    ("Cuda", ep.DeviceError, {}),
    ("Nccl", ep.DeviceError, {}),
    ("Process", ep.PeerError, {}),
    ("PeerFailed", ep.PeerError, dict(rank=1, peer=0, phase="combine/recv", call=4)),
    ("Unsupported", ep.UnsupportedError, {}),
    ("TooManyRanks", ep.UnsupportedError, dict(ranks=257, max=256)),
    ("NotBuilt", ep.NotBuiltError, {}),
])
def test_every_error_kind_raises_its_class_with_its_fields(kind, cls, fields):
    with pytest.raises(cls) as e:
        ep._native._raise_sample_error(kind)
    assert isinstance(e.value, ep.EpError)
    assert e.value.kind == ("Timeout" if kind == "GpuTimeout" else kind)
    for name, value in fields.items():
        assert getattr(e.value, name) == value, name
    if kind == "Timeout":
        assert str(e.value) == ("rank 1 timed out after 2000 ms waiting for rank 3 in "
                                "combine/recv (call 7)")


def test_masked_routing_is_the_contracts_rule():
    """masked_routing: a masked rank sends nothing, a slot naming a masked rank's expert is -1
    (R = 3, E = 6: rank d owns experts 2d and 2d + 1), the inputs are left as they were."""
    t0 = np.array([[0, 3, -1], [5, 2, 1]], np.int64)
    t1 = np.array([[4, 1, 0]], np.int64)
    t2 = np.array([[2, 3, 5]], np.int64)
    got = oracle.masked_routing([t0, t1, t2], 6, {1})
    assert got[0].tolist() == [[0, -1, -1], [5, -1, 1]]
    assert got[1].tolist() == [[-1, -1, -1]]
    assert got[2].tolist() == [[-1, -1, 5]]
    assert t0.tolist() == [[0, 3, -1], [5, 2, 1]]
