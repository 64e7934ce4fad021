//! The GPU's LogFMT arithmetic (kernels/src/cu/logfmt.cuh), written out here in the same f32
//! steps, against the reference's definitions (`numerics::logfmt`): the GPU encoder finds most
//! codes from a log-domain estimate and a proven error margin, without an exp2, and decodes with
//! a round-down add for the floor and an exponent add in place of `pow2i`; both must give the
//! reference's bits, and the encoder's byte layout (8 lanes a group, 5 words a lane) the
//! reference's bytes. These
//! tests check the mirror, value by value, over many grids (every magnitude up to each grid's
//! amax); the GPU tests (kernels/tests/gpu/logfmt.rs) check the CUDA code against the oracle.
//!
//! `EP_LOGFMT_GRIDS=n` sets the random grids of the exhaustive code test (default 1500).

use ep_reference::numerics::logfmt::{Grid, Meta, EXP2_POLY, LOG2_MANTISSA, TOP_CODE};

/// The CUDA header whose arithmetic this file mirrors: its constants are read from it.
const LOGFMT_CUH: &str = include_str!("../../kernels/src/cu/logfmt.cuh");

/// The f32 bits of `#define NAME 0x...u` in logfmt.cuh.
fn cuh_bits(name: &str) -> u32 {
    let key = format!("#define {name} ");
    let line = LOGFMT_CUH
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("logfmt.cuh defines no {name}"));
    let word = line[key.len()..].split_whitespace().next().unwrap_or("");
    let hex = word.trim_start_matches("0x").trim_end_matches('u');
    u32::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{name}: {word}: {e}"))
}

/// The margin, in code units: (A + B |E|) / step + K, E amax's exponent (|E| >= |log2 amax|);
/// logfmt.cuh's error analysis needs (5.93e-7 + 5.96e-8 |E|) / step + 7.64e-5 (the threshold
/// model's bound plus the estimate's). A margin of MAX or more (step below about 6e-5) leaves no
/// fast case. LN2_8: ln(2) / 8, for h(s) = 1 - log2(1 + 2^-s) ~ s/2 - s^2 ln(2)/8.
struct Consts {
    a: f32,
    b: f32,
    k: f32,
    max: f32,
    ln2_8: f32,
}

fn consts() -> Consts {
    let f = |n: &str| f32::from_bits(cuh_bits(n));
    let c = Consts {
        a: f("LF_MARGIN_A"),
        b: f("LF_MARGIN_B"),
        k: f("LF_MARGIN_K"),
        max: f("LF_MARGIN_MAX"),
        ln2_8: f("LF_LN2_8"),
    };
    // The analysis' bounds, with a factor 2 to spare, and ln(2)/8 itself.
    assert!(
        c.a >= 2.0 * 5.93e-7 && c.b >= 2.0 * 5.96e-8 && c.k >= 2.0 * 7.64e-5,
        "margin constants below the bound"
    );
    assert!(c.max <= 0.45);
    assert_eq!(c.ln2_8, (std::f64::consts::LN_2 / 8.0) as f32);
    c
}

/// 1.5 * 2^23: added to a float of magnitude below 2^22, it leaves the integer part in the
/// sum's low mantissa bits.
const MAGIC: f32 = 12_582_912.0;

/// `a + b` rounded toward minus infinity (the GPU's `__fadd_rd`), from the round-to-nearest sum
/// and its exact error (TwoSum): the sum, or the float below it where the sum rounded up.
fn fadd_rd(a: f32, b: f32) -> f32 {
    let s = a + b;
    let bb = s - a;
    let err = (a - (s - bb)) + (b - bb);
    if err < 0.0 {
        // The float below s (s is finite and, for every use here, positive).
        if s > 0.0 {
            f32::from_bits(s.to_bits() - 1)
        } else if s < 0.0 {
            f32::from_bits(s.to_bits() + 1)
        } else {
            -f32::from_bits(1)
        }
    } else {
        s
    }
}

/// T'[m] = LOG2_MANTISSA[m] - m/128 (exact), the encoder's table (lf_s_log2).
fn t_prime(m: usize) -> f32 {
    f32::from_bits(LOG2_MANTISSA[m]) - m as f32 * 0.0078125
}

/// What the GPU computes once per packed group (lf_consts, phase B of lf_encode_rows), and per
/// unit in phase C (kf, r128).
struct Fast {
    /// 1 / step, and its 1/128 (exact).
    rs: f32,
    r128: f32,
    /// fma(-q, 1/step, -0.5), q = (log2 amax - E) - h(step).
    bc: f32,
    /// Fast iff |v - rint(v)| < mh = 1/2 - margin (0: never).
    mh: f32,
    /// 2^23 + amax's exponent bits, as f32.
    kf: f32,
    /// 0x4B000000 + the bound of threshold(1) where amin is below it, else 0 (no code 0).
    zb: u32,
}

/// lf_zero_bound: a < k1 iff float(a) < threshold(1).
fn zero_bound(g: &Grid) -> u32 {
    let thr1 = g.magnitude(1) * 0.5;
    (thr1.to_bits() + 0xFFFF) >> 16
}

fn fast_of(c: &Consts, meta: Meta, g: &Grid) -> Fast {
    let eb = u32::from(meta.amax >> 7);
    let e = (eb as i32 - 127) as f32;
    let s = g.step;
    let hh = s * 0.5 - (s * s) * c.ln2_8;
    let rs = 1.0 / s;
    // Exact: la = fl(E + table), so la - E is a multiple of ulp(la) in [0, 1].
    let q = (g.log_amax - e) - hh;
    let bc = (-q).mul_add(rs, -0.5);
    let m = c.b.mul_add(-e, c.a).mul_add(rs, c.k);
    let mh = if m < c.max { 0.5 - m } else { 0.0 };
    let k1 = zero_bound(g);
    Fast {
        rs,
        r128: rs * 0.0078125,
        bc,
        mh,
        kf: f32::from_bits(0x4B00_0000 | (u32::from(meta.amax) & 0x7F80)),
        zb: if u32::from(meta.amin) < k1 {
            0x4B00_0000 + k1
        } else {
            0
        },
    }
}

/// The reference's correction loops from `c` (exact from any start).
fn search(g: &Grid, av: f32, mut c: u32) -> u32 {
    while c < TOP_CODE && g.threshold(c + 1) <= av {
        c += 1;
    }
    while c > 0 && g.threshold(c) > av {
        c -= 1;
    }
    c
}

/// lf_estimate: the code 511 + rint(v) and r = v - rint(v) for magnitude bits `a`, v clamped to
/// at least -510.
fn estimate(f: &Fast, a: u16) -> (u32, f32) {
    let mg = 0x4B00_0000 | u32::from(a);
    let tm = t_prime(usize::from(a & 0x7F));
    let fa = f32::from_bits(mg) - f.kf;
    let v = fa.mul_add(f.r128, tm.mul_add(f.rs, f.bc)).max(-510.0);
    let t = v + MAGIC;
    let r = v - (t - MAGIC);
    (t.to_bits().wrapping_sub(0x4B3F_FE01), r)
}

/// The GPU encoder's code of magnitude bits `a` (phase C of lf_encode_rows), and whether it
/// took the exact search: the estimate, 0 below threshold(1) in a group that has such values,
/// the search where the estimate's fraction is within the margin of an integer.
fn fast_code(f: &Fast, g: &Grid, a: u16) -> (u32, bool) {
    let (e, r) = estimate(f, a);
    let mut c = e;
    if f.zb != 0 && (0x4B00_0000 | u32::from(a)) < f.zb {
        c = 0;
    }
    // NaN-safe as on the GPU: !(|r| < mh).
    if r.abs() >= f.mh || r.is_nan() {
        let av = f32::from_bits(u32::from(a) << 16);
        return (search(g, av, e.min(TOP_CODE)), true);
    }
    assert!(c <= TOP_CODE, "a fast code past 511: {c} for {a:#x}");
    (c, false)
}

/// The GPU decoder's magnitude of code c (lf_exp2 after the reference's y): floor(y) as the
/// round-down sum t = y + 1.5 * 2^23 less 1.5 * 2^23, f = y - floor(y), the polynomial, and t's
/// bits << 23 added to the polynomial's bits (p * 2^n exactly: the result is normal). No code 0
/// here: the decoder zeroes it only in groups whose amin is below threshold(1) (the only ones
/// whose encoder writes a code 0).
fn fast_magnitude_nz(g: &Grid, c: u32) -> f32 {
    let cf = f32::from_bits(0x4B00_0000 | c) - f32::from_bits(0x4B00_01FF); // c - 511, exact
    let y = cf.mul_add(g.step, g.log_amax);
    let t = fadd_rd(y, MAGIC);
    let f = y - (t - MAGIC);
    let a = |i: usize| f32::from_bits(EXP2_POLY[i]);
    let mut q = a(5);
    for i in (0..5).rev() {
        q = q.mul_add(f, a(i));
    }
    let p = q.mul_add(f, 1.0);
    f32::from_bits(p.to_bits().wrapping_add(t.to_bits() << 23))
}

/// The decoder's value of a 10-bit field of a group with meta `meta` (lf_reduce_at).
fn fast_decode(meta: Meta, g: &Grid, field: u32) -> f32 {
    let c = field & TOP_CODE;
    let zero_possible = u32::from(meta.amin) < zero_bound(g);
    let m = if c == 0 && zero_possible {
        0.0
    } else {
        fast_magnitude_nz(g, c)
    };
    f32::from_bits(m.to_bits() | (field & 0x200) << 22)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Grids that pack: edge cases (the smallest and largest amax, amin zero, subnormal, one step
/// below amax, at the 32-octave clip) and `random` random ones (amin log-uniform below amax).
fn grids(random: usize) -> Vec<Meta> {
    let mut v = Vec::new();
    for amax in [0x1100u16, 0x1101, 0x117F, 0x2000, 0x3C00, 0x3F00, 0x3F7F] {
        let e = amax >> 7;
        let clip = (e.saturating_sub(32)) << 7 | (amax & 0x7F);
        for amin in [
            0u16,
            1,
            0x7F,
            0x80,
            amax - 1,
            amax - 2,
            amax - 9,
            amax - 128,
            amax - 129,
        ] {
            v.push(Meta { amax, amin });
        }
        for d in [0i32, 1, -1, 2, -2, 64] {
            let amin = (clip as i32 + d).clamp(0, amax as i32 - 1) as u16;
            v.push(Meta { amax, amin });
        }
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..random {
        let amax = 0x1100 + rng.below(0x3F80 - 0x1100) as u16;
        let amin = match rng.below(8) {
            0 => 0,
            1 => rng.below(0x80) as u16,
            2 => amax - 1 - rng.below(16.min(u64::from(amax) - 1)) as u16,
            // Log-uniform: up to 40 octaves (5120 bf16 steps) below amax.
            _ => amax.saturating_sub(1 + rng.below(5120) as u16),
        };
        v.push(Meta { amax, amin });
    }
    v
}

fn grid_count() -> usize {
    std::env::var("EP_LOGFMT_GRIDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500)
}

#[test]
fn gpu_codes_equal_the_reference_for_every_magnitude_of_every_grid() {
    let cs = consts();
    let (mut values, mut slow, mut wide_values, mut wide_slow) = (0u64, 0u64, 0u64, 0u64);
    for meta in grids(grid_count()) {
        assert!(meta.is_packed(), "{meta:?}");
        let g = meta.grid().unwrap();
        let f = fast_of(&cs, meta, &g);
        // A span of an octave or more: the fast case must be the rule there.
        let wide = g.step * 510.0 >= 1.0;
        // Every magnitude a group of this meta word can hold (amin is its smallest).
        for a in meta.amin..=meta.amax {
            let (c, s) = fast_code(&f, &g, a);
            assert_eq!(c, g.code(a), "a = {a:#x} in {meta:?} ({g:?})");
            values += 1;
            slow += u64::from(s);
            if wide {
                wide_values += 1;
                wide_slow += u64::from(s);
            }
        }
    }
    let share = wide_slow as f64 / wide_values as f64;
    println!(
        "{values} codes equal; exact search for {slow} ({:.4}%), {:.4}% where the span is an octave or more",
        100.0 * slow as f64 / values as f64,
        100.0 * share
    );
    assert!(
        share < 0.002,
        "the exact search ran for {:.3}% of the values",
        100.0 * share
    );
}

#[test]
fn gpu_codes_equal_the_reference_on_groups_like_the_benchmarks() {
    // Uniform values in [-0.5, 0.5] (ep-bench's LogFMT rows) and normal-like ones: every value
    // of every group, the groups' own grids.
    let cs = consts();
    let mut rng = Rng(7);
    let (mut values, mut slow, mut groups_slow) = (0u64, 0u64, 0u64);
    for i in 0..4000 {
        let group: Vec<u16> = (0..128)
            .map(|_| {
                let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                let x = if i % 2 == 0 {
                    u - 0.5
                } else {
                    // A sum of uniforms: roughly normal, scale 0.1.
                    let s: f32 = (0..4)
                        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32)
                        .sum();
                    (s - 2.0) * 0.17 + u * 1e-3
                };
                half::bf16::from_f32(x).to_bits()
            })
            .collect();
        let meta = Meta::of(group.iter().copied());
        let Some(g) = meta.grid() else { continue };
        let f = fast_of(&cs, meta, &g);
        let mut any = false;
        for &b in &group {
            let (c, s) = fast_code(&f, &g, b & 0x7FFF);
            assert_eq!(c, g.code(b & 0x7FFF), "{b:#x} in {meta:?}");
            values += 1;
            slow += u64::from(s);
            any |= s;
        }
        groups_slow += u64::from(any);
    }
    println!(
        "{values} values: exact search for {slow}; {groups_slow} of 4000 groups had one or more"
    );
    assert!(
        groups_slow < 800,
        "{groups_slow} of 4000 groups needed the exact search"
    );
}

#[test]
fn gpu_magnitudes_equal_the_reference_for_every_code_of_every_grid() {
    for meta in grids(grid_count() / 3) {
        let g = meta.grid().unwrap();
        for c in 1..=TOP_CODE {
            let (got, want) = (fast_magnitude_nz(&g, c), g.magnitude(c));
            assert_eq!(got.to_bits(), want.to_bits(), "c = {c} in {meta:?} ({g:?})");
        }
        // Code 0 is zero wherever the encoder can write it: only below threshold(1), so only
        // in a group whose amin is below it (the decoder's flag).
        let zero_possible = u32::from(meta.amin) < zero_bound(&g);
        assert_eq!(
            zero_possible,
            g.code(meta.amin) == 0,
            "{meta:?}: amin's code and the decoder's zero flag"
        );
        if zero_possible {
            for field in [0u32, 0x200] {
                assert_eq!(
                    fast_decode(meta, &g, field).to_bits(),
                    g.decode(field).to_bits()
                );
            }
        }
    }
}

#[test]
fn the_round_down_add_and_floor_agree() {
    // fadd_rd (the mirror of __fadd_rd) against exact sums in f64, and the decoder's floor
    // against floorf, over every 7th f32 in [-126, 0] and every value near an integer there.
    let mut b = (-126f32).to_bits();
    let top = (-0f32).to_bits();
    let check = |y: f32| {
        let t = fadd_rd(y, MAGIC);
        assert_eq!(t - MAGIC, y.floor(), "{y}");
        // Where f64 holds the sum exactly, t is the float at or below it.
        let exact = f64::from(y) + f64::from(MAGIC);
        if exact - f64::from(MAGIC) == f64::from(y) {
            assert!(
                f64::from(t) <= exact && exact - f64::from(t) < 1.0,
                "{y}: {t}"
            );
        }
    };
    while b > top {
        check(f32::from_bits(b));
        b -= 7.min(b - top);
    }
    for n in -126..0 {
        for d in 0..64u32 {
            let y = n as f32;
            check(f32::from_bits(y.to_bits() + d));
            if n > -126 {
                check(f32::from_bits(y.to_bits() - d));
            }
        }
    }
}

#[test]
fn exp2_poly_error_is_within_what_the_margin_assumes() {
    // The margin takes |E(y) / 2^y - 1| <= 2e-7 (the reference documents below 2e-7): every
    // 31st f32 in [-126, 0], and around every integer (where f wraps from 1 to 0).
    let worst = |y: f32| {
        let e = ep_reference::numerics::logfmt::exp2_poly(y) as f64;
        (e / (y as f64).exp2() - 1.0).abs()
    };
    let (lo, hi) = ((-126f32).to_bits(), (-0f32).to_bits());
    let mut max = 0f64;
    let mut b = lo;
    while b > hi {
        max = max.max(worst(f32::from_bits(b)));
        b -= 31.min(b - hi);
    }
    for n in -126..=0 {
        let y = n as f32;
        for d in 0..4096u32 {
            for yy in [
                f32::from_bits(y.to_bits() + d),
                f32::from_bits(y.to_bits().wrapping_sub(d)),
            ] {
                if (-126.0..=0.0).contains(&yy) {
                    max = max.max(worst(yy));
                }
            }
        }
    }
    println!("largest relative error of exp2_poly seen: {max:.3e}");
    assert!(max < 2e-7, "{max}");
}

/// Field i (10 bits at bit 10i) of a lane's 5 words set to `f`, as logfmt.cuh's slow-path patch;
/// `add`: the hot path's `+=` into zeroed bits instead.
fn put_field(wd: &mut [u32; 5], i: usize, f: u32, add: bool) {
    put_bits(wd, i, f, 0x3FF, add);
}

/// The bits `mask` of field i set to `f`'s (`add`: added into zeroed bits).
fn put_bits(wd: &mut [u32; 5], i: usize, f: u32, mask: u32, add: bool) {
    let b = 10 * i;
    let (k, o) = (b >> 5, (b & 31) as u32);
    if add {
        wd[k] = wd[k].wrapping_add(f << o);
        if o > 22 {
            wd[k + 1] = wd[k + 1].wrapping_add(f >> (32 - o));
        }
    } else {
        wd[k] = (wd[k] & !(mask << o)) | (f << o);
        if o > 22 {
            wd[k + 1] = (wd[k + 1] & !(mask >> (32 - o))) | (f >> (32 - o));
        }
    }
}

/// A packed group's body as phase C of lf_encode_rows writes it: lane l of the unit's 8 holds
/// channels 16l..16l+15 and forms body words 5l..5l+4: each field from the estimate (the sign
/// bit, then the code), then code 0 below threshold(1) where the group has such values, then
/// (in the staged words) the whole field from the exact search for the values whose fraction is
/// within the margin of 1/2.
/// Also returns how many values took the search.
fn gpu_body(f: &Fast, g: &Grid, vals: &[u16]) -> ([u8; 160], u32) {
    let mut body = [0u8; 160];
    let mut searched = 0;
    for l in 0..8 {
        let mut wd = [0u32; 5];
        let mut est = [0u32; 16];
        let mut slow = 0u32;
        for (i, e) in est.iter_mut().enumerate() {
            let b = vals[16 * l + i];
            let (c, r) = estimate(f, b & 0x7FFF);
            *e = c;
            if r.abs() >= f.mh || r.is_nan() {
                slow |= 1 << i;
            }
            put_field(&mut wd, i, c | u32::from(b >> 15) << 9, true);
        }
        let sign = |i: usize| u32::from(vals[16 * l + i] >> 15) << 9;
        // Code 0: the code bits cleared, the sign's kept.
        if f.zb != 0 {
            for i in 0..16 {
                if (0x4B00_0000 | u32::from(vals[16 * l + i] & 0x7FFF)) < f.zb {
                    put_bits(&mut wd, i, 0, TOP_CODE, false);
                }
            }
        }
        for (i, &e) in est.iter().enumerate() {
            if (slow >> i) & 1 != 0 {
                searched += 1;
                let a = vals[16 * l + i] & 0x7FFF;
                let c = search(g, f32::from_bits(u32::from(a) << 16), e.min(TOP_CODE));
                put_field(&mut wd, i, c | sign(i), false);
            }
        }
        for (k, w) in wd.iter().enumerate() {
            body[20 * l + 4 * k..20 * l + 4 * k + 4].copy_from_slice(&w.to_le_bytes());
        }
    }
    (body, searched)
}

#[test]
fn gpu_rounds_write_the_reference_bytes_and_decode_to_its_values() {
    use ep_reference::numerics::logfmt_wire::{decode_row, encode_row, max_row_bytes};
    use half::bf16;
    let cs = consts();
    let mut rng = Rng(11);
    let (mut searched, mut zeros) = (0u32, 0u32);
    for case in 0..48 {
        let gs = [1usize, 2, 3, 56, 57, 64, 100, 512][case % 8];
        let h = 128 * gs;
        // logfmt.cuh: rows a round, min(LF_ROWS, LF_UNITS / G).
        let rpr = 32usize.min(512 / gs);
        let nrows = 1 + rng.below(2 * rpr as u64 + 3) as usize;
        let rows: Vec<Vec<bf16>> = (0..nrows)
            .map(|_| {
                (0..h)
                    .map(|i| {
                        let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        // Every third group of a row raw (amax >= 1), the rest packed; in
                        // every fifth some zeros and values 2^-40 below the rest (a clipped
                        // grid: code 0 below threshold(1)).
                        let s = if (i / 128 + case) % 3 == 0 { 4.0 } else { 1.0 };
                        match (i / 128 + case) % 5 {
                            0 if i % 37 == 3 => bf16::from_f32(0.0),
                            0 if i % 41 == 5 => bf16::from_f32(-u * 1e-12),
                            _ => bf16::from_f32(u * s),
                        }
                    })
                    .collect()
            })
            .collect();
        for r0 in (0..nrows).step_by(rpr) {
            let nr = rpr.min(nrows - r0);
            let units = nr * gs;
            let bits = |u: usize| -> Vec<u16> {
                let (j, g) = (u / gs, u % gs);
                rows[r0 + j][g * 128..(g + 1) * 128]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            // (A) meta words, (B) packed flags.
            let metas: Vec<Meta> = (0..units).map(|u| Meta::of(bits(u))).collect();
            let mut mask = [0u32; 16];
            for (u, m) in metas.iter().enumerate() {
                mask[u >> 5] |= u32::from(m.is_packed()) << (u & 31);
            }
            // (C) each unit's body at the offset its row's flags give.
            let mut out = vec![vec![0u8; max_row_bytes(h)]; nr];
            for (u, meta) in metas.iter().enumerate() {
                let (j, g) = (u / gs, u % gs);
                let dst = &mut out[j];
                dst[4 * g..4 * g + 4].copy_from_slice(&meta.to_bytes());
                let (b0, b1) = (j * gs, j * gs + g);
                let mut np = 0usize;
                for (w, word) in mask.iter().enumerate().take((b1 + 31) >> 5).skip(b0 >> 5) {
                    let lo = b0.saturating_sub(32 * w);
                    let hi = (b1 - 32 * w).min(32);
                    let m =
                        (if hi >= 32 { u32::MAX } else { (1u32 << hi) - 1 }) & !((1u32 << lo) - 1);
                    np += (word & m).count_ones() as usize;
                }
                let at = gs * 4 + np * 160 + (g - np) * 256;
                let vals = bits(u);
                if let Some(grid) = meta.grid() {
                    let f = fast_of(&cs, *meta, &grid);
                    let (body, n) = gpu_body(&f, &grid, &vals);
                    dst[at..at + 160].copy_from_slice(&body);
                    searched += n;
                } else {
                    for (i, b) in vals.iter().enumerate() {
                        dst[at + 2 * i..at + 2 * i + 2].copy_from_slice(&b.to_le_bytes());
                    }
                }
            }
            for (j, got) in out.iter().enumerate() {
                let mut want = vec![0u8; max_row_bytes(h)];
                let n = encode_row(&rows[r0 + j], &mut want);
                assert_eq!(&got[..n], &want[..n], "case {case}, row {}", r0 + j);
                // The decoder's values: each packed field's fast_decode.
                let mut dec = vec![0f32; h];
                decode_row(&want[..n], &mut dec);
                let mut at = gs * 4;
                for g in 0..gs {
                    let m = Meta::from_bytes(want[4 * g..4 * g + 4].try_into().unwrap());
                    if let Some(grid) = m.grid() {
                        for c in 0..128 {
                            let bit = 10 * c;
                            let word = u32::from_le_bytes(
                                want[at + bit / 8..at + bit / 8 + 4].try_into().unwrap(),
                            );
                            let f = (word >> (bit % 8)) & 0x3FF;
                            let v = fast_decode(m, &grid, f);
                            zeros += u32::from(f & TOP_CODE == 0);
                            assert_eq!(
                                v.to_bits(),
                                dec[g * 128 + c].to_bits(),
                                "case {case} group {g} channel {c}"
                            );
                        }
                        at += 160;
                    } else {
                        at += 256;
                    }
                }
            }
        }
    }
    println!("rounds: {searched} values searched, {zeros} code-0 fields");
    assert!(
        searched > 0 && zeros > 0,
        "the rounds ran no search ({searched}) or wrote no code 0 ({zeros})"
    );
}

#[test]
fn a_patched_field_changes_its_ten_bits_and_no_other() {
    // put_field (logfmt.cuh's set_field) against the 160-bit string read bit by bit.
    let mut rng = Rng(5);
    let bit = |wd: &[u32; 5], j: usize| (wd[j / 32] >> (j % 32)) & 1;
    for _ in 0..20_000 {
        let mut wd = [0u32; 5];
        for w in wd.iter_mut() {
            *w = rng.next() as u32;
        }
        let (i, f) = (rng.below(16) as usize, rng.below(1024) as u32);
        let before = wd;
        put_field(&mut wd, i, f, false);
        for j in 0..160 {
            let want = if (10 * i..10 * i + 10).contains(&j) {
                (f >> (j - 10 * i)) & 1
            } else {
                bit(&before, j)
            };
            assert_eq!(bit(&wd, j), want, "field {i} = {f:#x}, bit {j}");
        }
    }
}
