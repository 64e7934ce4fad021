//! The GPU's LogFMT arithmetic (kernels/src/cu/logfmt.cuh), written out here in the same f32
//! steps, against the reference's definitions (`numerics::logfmt`): the GPU encoder finds most
//! codes from a log-domain estimate and a proven error margin, without an exp2, and decodes with
//! a floor and an exponent add in place of `pow2i`; both must give the reference's bits. These
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
/// logfmt.cuh's error analysis needs (5.24e-7 + 6e-8 |E|) / step + 1.228e-4. A margin of MAX or
/// more (step below about 6e-5) leaves no fast case. LN2_8: ln(2) / 8, for h(s) = 1 - log2(1 +
/// 2^-s) ~ s/2 - s^2 ln(2)/8.
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
        c.a >= 2.0 * 5.24e-7 && c.b >= 2.0 * 6e-8 && c.k >= 2.0 * 1.228e-4,
        "margin constants below the bound"
    );
    assert!(c.max <= 0.45);
    assert_eq!(c.ln2_8, (std::f64::consts::LN_2 / 8.0) as f32);
    c
}

/// What the GPU computes once per packed group (phase B of lf_encode_rows).
struct Fast {
    /// (log2 amax - E) - h(step): log2 amax's mantissa part less the midpoint offset.
    q: f32,
    /// 1 / step.
    rs: f32,
    /// threshold(1) = m(1) / 2 and threshold(2) = (m(1) + m(2)) / 2, exactly as the reference.
    thr1: f32,
    thr2: f32,
    /// Fast iff the estimate's fraction lies in (mg, mhi).
    mg: f32,
    mhi: f32,
    /// 2^23 + amax's biased exponent, as f32 (the exponent difference by one subtraction).
    ebias: f32,
}

fn fast_of(c: &Consts, meta: Meta, g: &Grid) -> Fast {
    let eb = u32::from(meta.amax >> 7);
    let e = eb as i32 - 127;
    let s = g.step;
    // Exact: la = fl(E + table), so la - E is a multiple of ulp(la) in [0, 1].
    let le = g.log_amax - e as f32;
    let hh = s * 0.5 - (s * s) * c.ln2_8;
    let rs = 1.0 / s;
    let m = c.b.mul_add(-e as f32, c.a).mul_add(rs, c.k);
    let mg = if m < c.max { m } else { 0.5 };
    let (m1, m2) = (g.magnitude(1), g.magnitude(2));
    Fast {
        q: le - hh,
        rs,
        thr1: m1 * 0.5,
        thr2: (m1 + m2) * 0.5,
        mg,
        mhi: 1.0 - mg,
        ebias: f32::from_bits(0x4B00_0000 | eb),
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

/// The GPU encoder's code of magnitude bits `a`, and whether it took the exact search.
fn fast_code(f: &Fast, g: &Grid, a: u16) -> (u32, bool) {
    let av = f32::from_bits(u32::from(a) << 16);
    if av < f.thr2 {
        return (u32::from(av >= f.thr1), false);
    }
    assert!(a >= 0x80, "a normal magnitude past threshold(2): {a:#x}");
    let fdi = f32::from_bits(0x4B00_0000 | u32::from(a >> 7)) - f.ebias;
    let dt = f32::from_bits(LOG2_MANTISSA[usize::from(a & 0x7F)]) - f.q;
    let w = fdi + dt;
    let v = w * f.rs;
    let n = v.floor();
    let r = v - n;
    let c = 511 + n as i32;
    if r > f.mg && r < f.mhi {
        return (c.min(511) as u32, false);
    }
    (search(g, av, c.clamp(0, 511) as u32), true)
}

/// The GPU decoder's magnitude of code c: y as the reference, then floor, the polynomial, and
/// the exponent added to the polynomial's bits (p * 2^n exactly: the result is normal).
fn fast_magnitude(g: &Grid, c: u32) -> f32 {
    let cf = f32::from_bits(0x4B00_0000 | c) - f32::from_bits(0x4B00_01FF); // c - 511, exact
    let y = cf.mul_add(g.step, g.log_amax);
    let n = y.floor();
    let f = y - n;
    let a = |i: usize| f32::from_bits(EXP2_POLY[i]);
    let mut q = a(5);
    for i in (0..5).rev() {
        q = q.mul_add(f, a(i));
    }
    let p = q.mul_add(f, 1.0);
    let tb = (n + 12_582_912.0).to_bits(); // 0x4B40_0000 + n: its low 9 bits are n's
    let m = f32::from_bits(p.to_bits().wrapping_add(tb << 23));
    if c == 0 {
        0.0
    } else {
        m
    }
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
        for a in 0..=meta.amax {
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
        for c in 0..=TOP_CODE {
            let (got, want) = (fast_magnitude(&g, c), g.magnitude(c));
            assert_eq!(got.to_bits(), want.to_bits(), "c = {c} in {meta:?} ({g:?})");
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

/// Word `w` of a packed body whose lane j holds bits 40j..40j+39 in `v[j]` (logfmt.cuh
/// lf_body_word).
fn body_word(v: &[u64; 32], w: usize) -> u32 {
    let a = 4 * w / 5;
    let o = 32 * w - 40 * a;
    let (lo, hi) = (v[a & 31], v[(a + 1) & 31]);
    ((lo >> o) | (hi.checked_shl(40 - o as u32).unwrap_or(0))) as u32
}

#[test]
fn gpu_rounds_write_the_reference_bytes_and_decode_to_its_values() {
    use ep_reference::numerics::logfmt_wire::{decode_row, encode_row, max_row_bytes};
    use half::bf16;
    let cs = consts();
    let mut rng = Rng(11);
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
                        // Every third group of a row raw (amax >= 1), the rest packed.
                        let s = if (i / 128 + case) % 3 == 0 { 4.0 } else { 1.0 };
                        bf16::from_f32(u * s)
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
                    let mut lanes = [0u64; 32];
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        for i in 0..4 {
                            let b = vals[4 * l + i];
                            let c = fast_code(&f, &grid, b & 0x7FFF).0;
                            *lane |= u64::from(u32::from(b >> 15) << 9 | c) << (10 * i);
                        }
                    }
                    for w in 0..40 {
                        dst[at + 4 * w..at + 4 * w + 4]
                            .copy_from_slice(&body_word(&lanes, w).to_le_bytes());
                    }
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
                // The decoder's values: each packed field's fast_magnitude with its sign.
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
                            let v = f32::from_bits(
                                fast_magnitude(&grid, f & 511).to_bits() | (f & 0x200) << 22,
                            );
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
}
