//! ep-bench's command-line words for `ep_reference`'s config errors: each names the flag that set
//! the bad value and says what would be accepted, instead of the config field alone.

use ep_reference::config::{MAX_EXPERTS, MAX_HIDDEN, MAX_RANKS, MAX_TOKENS_PER_RANK};
use ep_reference::options::MAX_STAGING_WORKERS;
use ep_reference::{Config, Error};

/// Which flags set each field of one point's config.
#[derive(Debug, Clone)]
pub struct Flags {
    /// The flag that set R: `--ranks`, or `--nprocs` in multi-process mode.
    pub ranks: &'static str,
    /// The flag that set T: `--tokens`, `--max-tokens` or `--sweep-tokens`.
    pub tokens: &'static str,
}

impl Default for Flags {
    fn default() -> Self {
        Flags {
            ranks: "--ranks",
            tokens: "--tokens",
        }
    }
}

/// The message for `e`, an error of `Config::new` (or of the token check) for `cfg`'s values.
pub fn explain(e: &Error, cfg: &Config, flags: &Flags) -> String {
    let (rf, tf) = (flags.ranks, flags.tokens);
    let field_flag = |what: &str| match what {
        "num_ranks" => rf,
        "num_experts" => "--experts",
        "max_tokens_per_rank" => tf,
        "hidden" => "--hidden",
        "staging_workers" => "--workers",
        "iters" => "--iters",
        "warmup" => "--warmup",
        _ => "",
    };
    match e {
        Error::ZeroSize { what } => format!("{} must be at least 1, got 0", field_flag(what)),
        Error::ExpertsNotDivisible { experts, ranks } => {
            let lo = experts / ranks * ranks;
            let hint = if lo == 0 {
                format!("e.g. --experts {ranks}")
            } else {
                format!("e.g. --experts {lo} or --experts {}", lo + ranks)
            };
            format!(
                "--experts {experts} is not a multiple of {rf} {ranks}: every rank holds the same number of experts ({hint})"
            )
        }
        Error::TooManyLocalExperts { local, max } => format!(
            "--experts {} over {rf} {} is {local} experts per rank, more than the {max} a rank can hold: lower --experts or raise {rf}",
            cfg.num_experts, cfg.num_ranks
        ),
        Error::HiddenNotMultiple {
            hidden,
            multiple,
            mode,
        } => {
            if *mode == "logfmt" {
                return format!(
                    "--hidden {hidden} is not a multiple of 128 (--logfmt encodes groups of 128 channels): use e.g. --hidden {}, or drop --logfmt",
                    hidden.next_multiple_of(128)
                );
            }
            let why = if *multiple == 512 {
                "--dispatch fp8 with --ue8m0 packs four scales of 128 channels per i32"
            } else {
                "--dispatch fp8 has one scale per 128 channels"
            };
            format!(
                "--hidden {hidden} is not a multiple of {multiple} ({why}): use e.g. --hidden {}, or --dispatch bf16, which takes any --hidden",
                hidden.next_multiple_of(*multiple)
            )
        }
        Error::TopKOutOfRange { top_k } => {
            format!("--top-k {top_k} is outside 1..=16 (experts per token)")
        }
        Error::Ue8m0WithoutRoundScale => {
            "--ue8m0 needs --round-scale (UE8M0 stores power-of-two scales): add --round-scale"
                .to_string()
        }
        Error::LimitExceeded { what, value, limit } => {
            let flag = field_flag(what);
            if !flag.is_empty() {
                let max = match *what {
                    "staging_workers" => MAX_STAGING_WORKERS,
                    "iters" => crate::spec::MAX_ITERS,
                    "warmup" => crate::spec::MAX_WARMUP,
                    "num_ranks" => MAX_RANKS,
                    "num_experts" => MAX_EXPERTS,
                    "max_tokens_per_rank" => MAX_TOKENS_PER_RANK,
                    _ => MAX_HIDDEN,
                };
                format!("{flag} {value} exceeds the supported maximum {max}")
            } else if what.starts_with("dispatch layout rows") {
                format!(
                    "--experts {} x {tf} {} = {value} rows in each rank's dispatch layout, more than {limit} (the kernels' 32-bit row indices): lower --experts or {tf}",
                    cfg.num_experts, cfg.max_tokens_per_rank
                )
            } else if what.starts_with("combine entries") {
                format!(
                    "{rf} {} x {tf} {} x --top-k {} = {value} combine entries per rank, more than {limit}: lower one of them",
                    cfg.num_ranks, cfg.max_tokens_per_rank, cfg.top_k
                )
            } else {
                format!(
                    "{what} = {value} exceeds {limit}: lower --hidden, --experts or {tf}"
                )
            }
        }
        Error::TooManyTokens { tokens, max, .. } => format!(
            "--tokens {tokens} exceeds --max-tokens {max} (T, the most tokens a rank may send): raise --max-tokens or lower --tokens"
        ),
        Error::OutOfMemory { needed, available } => format!(
            "the communication buffers need {}, and {} is available: lower --tokens, --hidden, --experts or {rf}",
            crate::memory::gb(*needed),
            crate::memory::gb(*available)
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    fn std_cfg() -> Config {
        // The values are only read for the message; build one unvalidated.
        Config {
            num_ranks: 8,
            num_experts: 100,
            max_tokens_per_rank: 128,
            hidden: 7168,
            top_k: 8,
            mode: Mode::FP8,
        }
    }

    #[test]
    fn every_config_error_names_its_flag() {
        let c = std_cfg();
        let f = Flags::default();
        let m = |e: Error| explain(&e, &c, &f);
        let s = m(Config::new(8, 100, 128, 7168, 8, Mode::FP8).unwrap_err());
        assert!(
            s.contains("--experts 100 is not a multiple of --ranks 8"),
            "{s}"
        );
        assert!(s.contains("--experts 96 or --experts 104"), "{s}");
        let s = m(Config::new(8, 256, 128, 100, 8, Mode::FP8).unwrap_err());
        assert!(
            s.contains("--hidden 100")
                && s.contains("--hidden 128")
                && s.contains("--dispatch bf16"),
            "{s}"
        );
        let s = m(Config::new(8, 256, 128, 7168, 17, Mode::FP8).unwrap_err());
        assert!(s.contains("--top-k 17"), "{s}");
        let s = m(Config::new(
            8,
            256,
            128,
            7168,
            8,
            Mode::Fp8 {
                round_scale: false,
                ue8m0: true,
            },
        )
        .unwrap_err());
        assert!(s.contains("--round-scale"), "{s}");
        let s = m(Config::new(8, 256, 100_000, 7168, 8, Mode::FP8).unwrap_err());
        assert_eq!(s, "--tokens 100000 exceeds the supported maximum 65536");
        let s = m(Config::new(0, 256, 128, 7168, 8, Mode::FP8).unwrap_err());
        assert_eq!(s, "--ranks must be at least 1, got 0");
        let workers = ep_reference::CpuOptions {
            staging_workers: 300,
            ..Default::default()
        };
        let s = m(workers.check().unwrap_err());
        assert_eq!(s, "--workers 300 exceeds the supported maximum 256");
        let s = m(Error::ZeroSize { what: "iters" });
        assert_eq!(s, "--iters must be at least 1, got 0");
        let s = m(Error::LimitExceeded {
            what: "warmup",
            value: 1 << 20,
            limit: 100_000,
        });
        assert_eq!(s, "--warmup 1048576 exceeds the supported maximum 100000");
        let nprocs = Flags {
            ranks: "--nprocs",
            tokens: "--max-tokens",
        };
        let c = Config {
            num_experts: 1 << 16,
            max_tokens_per_rank: 1 << 16,
            ..std_cfg()
        };
        let e = Config::new(8, 1 << 16, 1 << 16, 7168, 8, Mode::FP8).unwrap_err();
        let s = explain(&e, &c, &nprocs);
        assert!(s.contains("--experts 65536 x --max-tokens 65536"), "{s}");
    }
}
