//! `ep-gpu-mp`'s arguments (issue 20 item 7.4): a bad number names its flag and exits 2, never a
//! panic. Needs no GPU: every case is refused before a device is touched.

use std::process::Command;

fn ep_gpu_mp(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ep-gpu-mp"))
        .args(args)
        // Not a rank of someone else's job.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("EP_LAUNCHER")
        .output()
        .expect("ep-gpu-mp starts");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_numbers_name_their_flag_and_exit_2() {
    for args in [
        &["--nprocs", "abc"][..],
        &["--nprocs", "-3"],
        &["--nprocs", "0"],
        &["--nprocs", "18446744073709551615"],
        &["--nprocs", "18446744073709551615", "--nodes", "2"],
        &["--nprocs", "2", "--nodes", "two"],
        &["--nprocs", "2", "--launch-timeout-s", "soon"],
        // Without --nprocs: one rank's own flags.
        &["--iters", "many"],
        &["--timeout-ms", "1e3"],
    ] {
        let (code, err) = ep_gpu_mp(args);
        let (flag, value) = args
            .chunks(2)
            .find(|p| p[1].parse::<usize>().map_or(true, |n| n == 0 || n > 1024))
            .map(|p| (p[0], p[1]))
            .unwrap();
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(value) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}
