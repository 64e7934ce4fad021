//! Needs only NVRTC (no GPU): every kernel compiles for sm_90, and ptxas's register/spill report
//! is printed; then the on-disk kernel cache runs its whole path with the real compiler (compile
//! and store, load back the same bytes, a corrupt entry recompiled and rewritten). A custom
//! runner (`harness = false`): where libnvrtc cannot be opened it prints `SKIPPED: ...` and
//! reports the checks as skipped, not passed; a failure exits non-zero.

use ep_kernels::compile::{self, cache, Origin, FAMILIES};
use ep_kernels::runtime::Variant;
use std::time::Instant;

fn main() {
    if !compile::nvrtc_present() {
        println!("SKIPPED: every_kernel_compiles_for_sm90_with_nvrtc: libnvrtc not found (put it on LD_LIBRARY_PATH)");
        println!("SKIPPED: disk_cache_compiles_stores_and_loads: libnvrtc not found (put it on LD_LIBRARY_PATH)");
        println!("compile check: 0 passed; 0 failed; 2 skipped");
        return;
    }
    every_kernel_compiles();
    disk_cache_compiles_stores_and_loads();
    println!("compile check: 2 passed; 0 failed; 0 skipped");
}

fn every_kernel_compiles() {
    for f in FAMILIES {
        let c = compile::compile(&f, "sm_90", true)
            .unwrap_or_else(|e| panic!("{} failed to compile: {e}", f.name));
        assert!(!c.cubin.is_empty(), "{}: empty CUBIN", f.name);
        println!(
            "== {} (sm_90, {:?})\n{}",
            f.name,
            compile::options("sm_90", true),
            c.log.trim_end()
        );
        for k in f.kernels {
            // ptxas names every entry it compiles: the symbol the runtime loads must be one.
            assert!(
                c.log.contains(&format!("'{}'", k.symbol)),
                "{}: ptxas compiled no entry {} ({})",
                f.name,
                k.symbol,
                k.name
            );
            // The kernel's machine code, in bytes (its `.text.<symbol>` section): every SM
            // fetches what a launch executes into a cold instruction cache, so code size is a
            // cost of its own (the phase profile's receive halves in BENCHMARKS.md show it).
            let bytes = text_bytes(&c.cubin, k.symbol)
                .unwrap_or_else(|| panic!("{}: no .text section for {}", f.name, k.symbol));
            assert!(bytes > 0, "{}: {} has no code", f.name, k.symbol);
            println!("code size: {} {bytes} bytes of SASS", k.name);
        }
        assert!(
            !c.log.contains("bytes spill stores")
                || c.log
                    .lines()
                    .filter(|l| l.contains("spill stores"))
                    .all(|l| l.contains(" 0 bytes spill stores")),
            "{}: a kernel spills registers:\n{}",
            f.name,
            c.log
        );
    }
    println!("compiled {} modules for sm_90", FAMILIES.len());
    // The other builds (runtime::Variant): past 32 ranks wide peer sets, a 256-entry IoTable (a
    // 22.7 KB kernel parameter), two blocks per SM, a one-entry IoTable (one rank on the GPU);
    // and each of those and the narrow one plain
    // (no NCCL or shrink-mode code). Each must compile, its kernels must take no stack frame (a
    // copied parameter or a local array would show there), and only the two-blocks build (64
    // registers a thread) may spill: its spills are printed. The plain narrow build's code sizes
    // are printed too: it is what a group on one node without shrink mode runs.
    // The batched family is loaded once per stage (Variant::at_stage): stages 1 and 2 of every
    // build, besides each build's stage 0.
    let staged = Variant::all()
        .into_iter()
        .flat_map(|v| (1..3).map(move |s| (v.at_stage(s), vec![compile::BATCHED])));
    let whole = Variant::all()
        .into_iter()
        .skip(1)
        .map(|v| (v, FAMILIES.to_vec()));
    for (v, families) in whole.chain(staged) {
        for f in families {
            let c = compile::compile_variant(&f, &v, "sm_90", true)
                .unwrap_or_else(|e| panic!("{} ({v:?}) failed to compile: {e}", f.name));
            println!("== {} {v:?}\n{}", f.name, c.log.trim_end());
            for k in f.kernels {
                assert!(
                    c.log.contains(&format!("'{}'", k.symbol)),
                    "{} ({v:?}): no {}",
                    f.name,
                    k.symbol
                );
                if v.at_stage(0) == Variant::for_group(1, 1, 132, true) {
                    let bytes = text_bytes(&c.cubin, k.symbol)
                        .unwrap_or_else(|| panic!("{}: no .text section for {}", f.name, k.symbol));
                    println!(
                        "code size (plain build, stage {}): {} {bytes} bytes of SASS",
                        v.stage, k.name
                    );
                }
            }
            if !v.two_blocks {
                assert!(
                    c.log
                        .lines()
                        .filter(|l| l.contains("spill stores"))
                        .all(|l| l.contains(" 0 bytes spill stores")),
                    "{} ({v:?}): a kernel spills registers:\n{}",
                    f.name,
                    c.log
                );
            }
        }
    }
    println!(
        "compiled the {} other builds, and the batched family of every build at stages 1 and 2, for sm_90",
        Variant::all().len() - 1
    );
    // The moe_layer example's own kernels (ep-group's example), with the options the example uses.
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(false),
        arch: Some("sm_90"),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        include_str!("../../group/examples/moe_layer.cu"),
        opts,
    )
    .unwrap_or_else(|e| panic!("group/examples/moe_layer.cu failed to compile: {e:?}"));
    let ptx = ptx.to_src();
    for k in ["moe_topk", "moe_expert"] {
        assert!(
            ptx.contains(k),
            "group/examples/moe_layer.cu: no entry {k} in the PTX"
        );
    }
    println!("compiled group/examples/moe_layer.cu for sm_90");
}

/// `cubin_cached` in a fresh folder, for every module: the first call compiles and stores, the
/// second loads the same bytes from disk (no compile), a truncated entry is recompiled and
/// rewritten, and a flipped byte likewise.
fn disk_cache_compiles_stores_and_loads() {
    let dir = std::env::temp_dir().join(format!("ep-kernel-cache-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut cold, mut warm) = (0.0f64, 0.0f64);
    for f in FAMILIES {
        let t = Instant::now();
        let (first, o) = compile::cubin_cached(&f, "sm_90", Some(&dir))
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        cold += t.elapsed().as_secs_f64();
        let path = match o {
            Origin::Compiled {
                stored: Some(Ok(p)),
                ..
            } => p,
            other => panic!("{}: first call: {other:?}", f.name),
        };
        assert_eq!(
            path,
            cache::entry_path(&dir, &compile::cache_key(&f, "sm_90").unwrap())
        );
        let t = Instant::now();
        let (again, o) = compile::cubin_cached(&f, "sm_90", Some(&dir)).unwrap();
        warm += t.elapsed().as_secs_f64();
        assert!(
            matches!(o, Origin::Disk(_)),
            "{}: second call: {o:?}",
            f.name
        );
        assert_eq!(again, first, "{}: the entry is not what was stored", f.name);
        let bytes = std::fs::read(&path).unwrap();
        for (what, bad) in [
            ("truncated", bytes[..bytes.len() - 100].to_vec()),
            ("flipped byte", {
                let mut b = bytes.clone();
                let mid = b.len() / 2;
                b[mid] ^= 0x40;
                b
            }),
        ] {
            std::fs::write(&path, &bad).unwrap();
            let (c, o) = compile::cubin_cached(&f, "sm_90", Some(&dir)).unwrap();
            assert!(
                matches!(&o, Origin::Compiled { found: Some(r), stored: Some(Ok(_)) } if r.contains("rejected")),
                "{} ({what}): {o:?}",
                f.name
            );
            assert_eq!(c.len(), first.len(), "{} ({what})", f.name);
            let (c, o) = compile::cubin_cached(&f, "sm_90", Some(&dir)).unwrap();
            assert!(
                matches!(o, Origin::Disk(_)),
                "{} ({what}): not rewritten",
                f.name
            );
            assert_eq!(c.len(), first.len());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "disk cache: {} modules compiled and stored in {cold:.2} s, loaded back in {:.1} ms; \
         corrupt entries recompiled and rewritten",
        FAMILIES.len(),
        warm * 1e3
    );
}

/// The size of section `.text.<symbol>` of an ELF64 little-endian image (a CUBIN), or None
/// when the image is not one or has no such section. Every offset is checked against the image.
fn text_bytes(elf: &[u8], symbol: &str) -> Option<u64> {
    let u16_at = |o: usize| -> Option<u64> {
        Some(u16::from_le_bytes(elf.get(o..o.checked_add(2)?)?.try_into().ok()?) as u64)
    };
    let u32_at = |o: usize| -> Option<u64> {
        Some(u32::from_le_bytes(elf.get(o..o.checked_add(4)?)?.try_into().ok()?) as u64)
    };
    let u64_at = |o: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            elf.get(o..o.checked_add(8)?)?.try_into().ok()?,
        ))
    };
    // ELF64: e_ident[EI_CLASS] = 2 (64-bit), [EI_DATA] = 1 (little-endian).
    if elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None;
    }
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let shentsize = usize::try_from(u16_at(0x3A)?).ok()?;
    let shnum = usize::try_from(u16_at(0x3C)?).ok()?;
    let shstrndx = usize::try_from(u16_at(0x3E)?).ok()?;
    let sh = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
    // Section header: sh_name u32 at 0, sh_offset u64 at 0x18, sh_size u64 at 0x20.
    let strtab = usize::try_from(u64_at(sh(shstrndx)?.checked_add(0x18)?)?).ok()?;
    let want = format!(".text.{symbol}");
    for i in 0..shnum {
        let h = sh(i)?;
        let name_at = strtab.checked_add(usize::try_from(u32_at(h)?).ok()?)?;
        let rest = elf.get(name_at..)?;
        let name = &rest[..rest.iter().position(|&b| b == 0)?];
        if name == want.as_bytes() {
            return u64_at(h.checked_add(0x20)?);
        }
    }
    None
}
