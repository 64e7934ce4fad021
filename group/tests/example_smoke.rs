//! The `moe_layer` example runs as a user would run it: built by cargo, started as a program.
//! Here (no GPU) it must say it skipped and why, and exit 0; on a GPU machine it must print
//! its PASS lines. A bad flag must be refused with exit code 2, naming the flag.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Builds the example with the profile of this test binary and returns its path.
fn example() -> PathBuf {
    // target/<profile>/deps/example_smoke-<hash>
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary under target/<profile>/deps")
        .to_path_buf();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "-p", "ep-group", "--example", "moe_layer"]);
    if release {
        c.arg("--release");
    }
    let st = c.status().expect("run cargo build");
    assert!(st.success(), "cargo build --example moe_layer failed: {st}");
    let bin = profile_dir
        .join("examples")
        .join(format!("moe_layer{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} was not built", bin.display());
    bin
}

fn run(args: &[&str]) -> Output {
    Command::new(example())
        .args(args)
        .output()
        .expect("start moe_layer")
}

#[test]
fn moe_layer_skips_or_passes_and_exits_0() {
    let gpu = ep_kernels::runtime::probe();
    for args in [&[][..], &["--nprocs", "2"][..]] {
        let o = run(args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "moe_layer {args:?}: {out}");
        match &gpu {
            Err(why) => {
                println!("SKIPPED (GPU part): {why}");
                assert!(
                    out.contains("SKIPPED: moe_layer: no usable GPU:"),
                    "moe_layer {args:?} without a GPU printed: {out}"
                );
                assert!(!out.contains("PASS"), "{out}");
            }
            Ok(_) => assert!(out.contains("PASS: moe_layer"), "{out}"),
        }
    }
}

#[test]
fn moe_layer_refuses_a_bad_flag() {
    // (flags, the flag and the value the refusal must name): clap's refusals, then a setting
    // each flag allows and the library's config refuses (checked before the GPU is looked at).
    for (args, flag, value) in [
        (&["--mode", "fp4"][..], "--mode", "fp4"),
        (&["--ranks", "0"][..], "--ranks", "'0'"),
        (&["--path", "per_expert"][..], "--path", "per_expert"),
        (&["--experts", "4097"][..], "--experts", "4097"),
        (&["--tokens"][..], "--tokens", ""),
        (&["--bogus", "1"][..], "--bogus", ""),
        (&["--top-k", "17"][..], "--top-k", "K=17"),
        (&["--ranks", "3"][..], "--ranks", "R=3"),
        (&["--nprocs", "3"][..], "--nprocs", "R=3"),
    ] {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "moe_layer {args:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(value),
            "moe_layer {args:?} said: {err}"
        );
    }
}
