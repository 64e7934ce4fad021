//! The torchrun-style process configuration, read from the environment.
//!
//! A launcher (torchrun, `mpirun` with a wrapper, Slurm with a wrapper, or this crate's
//! [`spawn_local`](crate::launcher::spawn_local)) starts one process per GPU and tells each one who
//! it is through environment variables:
//!
//! | variable           | meaning                                          | required |
//! |--------------------|--------------------------------------------------|----------|
//! | `RANK`             | global rank, `0..WORLD_SIZE`                     | yes      |
//! | `WORLD_SIZE`       | number of processes in the job, `>= 1`           | yes      |
//! | `LOCAL_RANK`       | rank on this node (picks the GPU), `0..LOCAL_WORLD_SIZE` | yes |
//! | `LOCAL_WORLD_SIZE` | processes on this node                           | no       |
//! | `MASTER_ADDR`      | host where rank 0 listens: a name, an IPv4 or IPv6 address (bare or in brackets, `[::1]`) | yes |
//! | `MASTER_PORT`      | TCP port where rank 0 listens, `1..=65535`       | yes      |
//!
//! The rendezvous port is `EP_RDZV_PORT` when set; otherwise `MASTER_PORT + 1` under torchrun
//! (`TORCHELASTIC_RUN_ID` set: torchrun's own store already listens on `MASTER_PORT` on rank 0's
//! host), otherwise `MASTER_PORT`.
//!
//! Who may join the job (see [`crate::auth`]):
//!
//! | variable        | meaning                                                              |
//! |-----------------|----------------------------------------------------------------------|
//! | `EP_JOB_TOKEN`  | the job's shared secret, the same on every rank, at least 16 bytes; [`spawn_local`](crate::launcher::spawn_local) sets a fresh one. Required when `MASTER_ADDR` is not loopback, unless `EP_RDZV_OPEN=1` |
//! | `EP_RDZV_OPEN`  | `1`: run without a token even across hosts (anyone who can reach the port can join) |
//! | `EP_JOB_ID`     | the job's identity, bound into every proof (default: torchrun's `TORCHELASTIC_RUN_ID`, else empty) |
//!
//! Every problem is a typed [`EnvError`] naming the variable and the value it had; nothing here
//! panics.

use std::time::Duration;

use crate::auth::{JobToken, MAX_JOB_ID_LEN};

/// Names of the variables, so callers and launchers spell them the same way (defined in
/// `crate::vars`).
pub use crate::vars::{
    EP_JOB_ID, EP_JOB_TOKEN, EP_LAUNCHER, EP_RDZV_LISTEN_FD, EP_RDZV_OPEN, EP_RDZV_PORT,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, TORCHELASTIC_RUN_ID, WORLD_SIZE,
};

/// What went wrong reading the process configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("environment variable {var} is not set (a torchrun-style launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")]
    Missing { var: &'static str },
    #[error("environment variable {var} is not valid unicode: {value}")]
    NotUnicode { var: &'static str, value: String },
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "environment variable {var}={value} is out of range: must be below {limit_var}={limit}"
    )]
    OutOfRange {
        var: &'static str,
        value: usize,
        limit_var: &'static str,
        limit: usize,
    },
}

/// One process's place in the job, as a torchrun-style launcher describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessConfig {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE` when the launcher sets it (torchrun and `spawn_local` do).
    pub local_world_size: Option<usize>,
    pub master_addr: String,
    pub master_port: u16,
    /// Where rank 0's rendezvous listens (see the module docs): `EP_RDZV_PORT`, else
    /// `MASTER_PORT + 1` under torchrun, else `MASTER_PORT`.
    pub rdzv_port: u16,
    /// `EP_JOB_TOKEN`, if set.
    pub job_token: Option<JobToken>,
    /// `EP_RDZV_OPEN=1`.
    pub open: bool,
    /// `EP_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else empty.
    pub job_id: String,
    /// `EP_RDZV_LISTEN_FD` (rank 0 under [`spawn_local`](crate::launcher::spawn_local)).
    pub listen_fd: Option<i32>,
}

impl ProcessConfig {
    /// Reads the configuration from this process's environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|var| match std::env::var(var) {
            Ok(v) => Ok(Some(v)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(os)) => Err(os.to_string_lossy().into_owned()),
        })
    }

    /// Reads the configuration through `lookup` (a variable name to `Ok(Some(value))`,
    /// `Ok(None)` when unset, or `Err(lossy value)` when it is not unicode). For tests and for
    /// programs that take the same settings from somewhere else.
    pub fn from_lookup<F>(lookup: F) -> Result<Self, EnvError>
    where
        F: Fn(&str) -> Result<Option<String>, String>,
    {
        let get = |var: &'static str| -> Result<Option<String>, EnvError> {
            lookup(var).map_err(|value| EnvError::NotUnicode { var, value })
        };
        let required = |var: &'static str| -> Result<String, EnvError> {
            get(var)?.ok_or(EnvError::Missing { var })
        };

        let world_size = parse_count(WORLD_SIZE, &required(WORLD_SIZE)?, 1)?;
        let rank = parse_count(RANK, &required(RANK)?, 0)?;
        if rank >= world_size {
            return Err(EnvError::OutOfRange {
                var: RANK,
                value: rank,
                limit_var: WORLD_SIZE,
                limit: world_size,
            });
        }
        let local_world_size = match get(LOCAL_WORLD_SIZE)? {
            None => None,
            Some(v) => {
                let n = parse_count(LOCAL_WORLD_SIZE, &v, 1)?;
                if n > world_size {
                    return Err(EnvError::Invalid {
                        var: LOCAL_WORLD_SIZE,
                        value: v,
                        reason: format!("more processes on this node than WORLD_SIZE={world_size}"),
                    });
                }
                Some(n)
            }
        };
        let local_rank = parse_count(LOCAL_RANK, &required(LOCAL_RANK)?, 0)?;
        let local_limit =
            local_world_size.map_or((WORLD_SIZE, world_size), |n| (LOCAL_WORLD_SIZE, n));
        if local_rank >= local_limit.1 {
            return Err(EnvError::OutOfRange {
                var: LOCAL_RANK,
                value: local_rank,
                limit_var: local_limit.0,
                limit: local_limit.1,
            });
        }

        let master_addr = required(MASTER_ADDR)?;
        let trimmed = master_addr.trim();
        if trimmed.is_empty() || trimmed.chars().any(char::is_whitespace) {
            return Err(EnvError::Invalid {
                var: MASTER_ADDR,
                value: master_addr,
                reason: "expected a host name or an IP address".into(),
            });
        }
        if let Err(reason) = crate::rendezvous::address::Host::parse(trimmed) {
            return Err(EnvError::Invalid {
                var: MASTER_ADDR,
                value: master_addr,
                reason,
            });
        }
        let master_addr = trimmed.to_string();

        let port_text = required(MASTER_PORT)?;
        let master_port = match port_text.trim().parse::<u16>() {
            Ok(0) => {
                return Err(EnvError::Invalid {
                    var: MASTER_PORT,
                    value: port_text,
                    reason: "port 0 cannot be connected to; pick a port in 1..=65535".into(),
                })
            }
            Ok(p) => p,
            Err(e) => {
                return Err(EnvError::Invalid {
                    var: MASTER_PORT,
                    value: port_text,
                    reason: format!("expected a TCP port in 1..=65535 ({e})"),
                })
            }
        };

        let rdzv_port =
            match get(EP_RDZV_PORT)? {
                Some(v) => match v.trim().parse::<u16>() {
                    Ok(p) if p != 0 => p,
                    _ => {
                        return Err(EnvError::Invalid {
                            var: EP_RDZV_PORT,
                            value: v,
                            reason: "expected a TCP port in 1..=65535".into(),
                        })
                    }
                },
                None if get(TORCHELASTIC_RUN_ID)?.is_some() => master_port
                    .checked_add(1)
                    .ok_or_else(|| EnvError::Invalid {
                        var: MASTER_PORT,
                        value: port_text.clone(),
                        reason: "under torchrun the rendezvous uses MASTER_PORT+1, which does not \
                             exist; set EP_RDZV_PORT"
                            .into(),
                    })?,
                None => master_port,
            };

        let job_token = match lookup(EP_JOB_TOKEN) {
            Ok(None) => None,
            // The value is a secret: errors give its length, never its text.
            Err(lossy) => {
                return Err(EnvError::Invalid {
                    var: EP_JOB_TOKEN,
                    value: format!("<hidden, {} bytes>", lossy.len()),
                    reason: "not valid unicode".into(),
                })
            }
            Ok(Some(v)) => {
                let len = v.len();
                Some(
                    JobToken::new(v.into_bytes()).map_err(|e| EnvError::Invalid {
                        var: EP_JOB_TOKEN,
                        value: format!("<hidden, {len} bytes>"),
                        reason: e.to_string(),
                    })?,
                )
            }
        };
        let open = match get(EP_RDZV_OPEN)? {
            None => false,
            Some(v) => match v.trim() {
                "" | "0" | "false" | "no" => false,
                "1" | "true" | "yes" => true,
                _ => {
                    return Err(EnvError::Invalid {
                        var: EP_RDZV_OPEN,
                        value: v,
                        reason: "expected 1 (run open, without a job token) or 0".into(),
                    })
                }
            },
        };
        let (id_var, job_id) = match get(EP_JOB_ID)? {
            Some(v) => (EP_JOB_ID, v),
            None => (
                TORCHELASTIC_RUN_ID,
                get(TORCHELASTIC_RUN_ID)?.unwrap_or_default(),
            ),
        };
        if job_id.len() > MAX_JOB_ID_LEN {
            return Err(EnvError::Invalid {
                var: id_var,
                value: format!("<{} bytes>", job_id.len()),
                reason: format!("longer than {MAX_JOB_ID_LEN} bytes"),
            });
        }

        let listen_fd = match get(EP_RDZV_LISTEN_FD)? {
            None => None,
            Some(v) => match v.trim().parse::<i32>() {
                Ok(fd) if fd >= 0 => Some(fd),
                _ => {
                    return Err(EnvError::Invalid {
                        var: EP_RDZV_LISTEN_FD,
                        value: v,
                        reason: "expected a file descriptor number".into(),
                    })
                }
            },
        };

        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            rdzv_port,
            job_token,
            open,
            job_id,
            listen_fd,
        })
    }

    /// The rendezvous settings for this process, with the given timeouts.
    pub fn rendezvous_config(
        &self,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> crate::rendezvous::RendezvousConfig {
        crate::rendezvous::RendezvousConfig {
            rank: self.rank,
            world_size: self.world_size,
            master_addr: self.master_addr.clone(),
            master_port: self.rdzv_port,
            connect_timeout,
            op_timeout,
            token: self.job_token.clone(),
            open: self.open,
            job_id: self.job_id.clone(),
            limits: crate::rendezvous::Limits::default(),
            inherited_listener: if self.rank == 0 { self.listen_fd } else { None },
        }
    }
}

fn parse_count(var: &'static str, value: &str, min: usize) -> Result<usize, EnvError> {
    match value.trim().parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(EnvError::Invalid {
            var,
            value: value.to_string(),
            reason: format!("{n} is below the minimum {min}"),
        }),
        Err(e) => Err(EnvError::Invalid {
            var,
            value: value.to_string(),
            reason: format!("expected a non-negative integer ({e})"),
        }),
    }
}

/// Whether a launcher (torchrun, [`spawn_local`](crate::launcher::spawn_local), or any other
/// torchrun-style one) started this process: `RANK` and `WORLD_SIZE` are both set. A program such
/// as `ep-bench --nprocs N` uses it to decide between running as one rank and spawning the N local
/// ranks itself.
pub fn is_launched_externally() -> bool {
    std::env::var_os(RANK).is_some() && std::env::var_os(WORLD_SIZE).is_some()
}

/// Whether this process was started by this crate's own launcher (`EP_LAUNCHER=ep-launch`).
pub fn is_launched_by_ep_launch() -> bool {
    std::env::var_os(EP_LAUNCHER).is_some_and(|v| v == "ep-launch")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<ProcessConfig, EnvError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ProcessConfig::from_lookup(|k| Ok(map.get(k).cloned()))
    }

    const GOOD: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "3"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(over: &[(&'static str, Option<&'static str>)]) -> Result<ProcessConfig, EnvError> {
        let mut v: Vec<(&str, &str)> = GOOD.to_vec();
        for (k, val) in over {
            v.retain(|(kk, _)| kk != k);
            if let Some(val) = val {
                v.push((k, val));
            }
        }
        cfg(&v)
    }

    #[test]
    fn good_config_parses() {
        let c = cfg(GOOD).unwrap();
        assert_eq!(
            c,
            ProcessConfig {
                rank: 3,
                world_size: 8,
                local_rank: 3,
                local_world_size: Some(4),
                master_addr: "127.0.0.1".into(),
                master_port: 29500,
                rdzv_port: 29500,
                job_token: None,
                open: false,
                job_id: String::new(),
                listen_fd: None,
            }
        );
        let c = with(&[("LOCAL_WORLD_SIZE", None)]).unwrap();
        assert_eq!(c.local_world_size, None);
    }

    #[test]
    fn rendezvous_port_avoids_torchruns_store() {
        let d = Duration::from_secs(1);
        assert_eq!(
            cfg(GOOD).unwrap().rendezvous_config(d, d).master_port,
            29500
        );
        let c = with(&[(TORCHELASTIC_RUN_ID, Some("none"))]).unwrap();
        assert_eq!((c.master_port, c.rdzv_port), (29500, 29501));
        assert_eq!(c.rendezvous_config(d, d).master_port, 29501);
        let c = with(&[
            (TORCHELASTIC_RUN_ID, Some("x")),
            (EP_RDZV_PORT, Some("31000")),
        ])
        .unwrap();
        assert_eq!(c.rdzv_port, 31000);
        assert!(matches!(
            with(&[(EP_RDZV_PORT, Some("0"))]),
            Err(EnvError::Invalid {
                var: EP_RDZV_PORT,
                ..
            })
        ));
        assert!(matches!(
            with(&[
                (TORCHELASTIC_RUN_ID, Some("x")),
                (MASTER_PORT, Some("65535"))
            ]),
            Err(EnvError::Invalid {
                var: MASTER_PORT,
                ..
            })
        ));
    }

    #[test]
    fn each_missing_variable_is_named() {
        for var in [RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT] {
            let err = with(&[(var, None)]).unwrap_err();
            assert_eq!(err, EnvError::Missing { var }, "removing {var}");
            assert!(err.to_string().contains(var));
        }
    }

    #[test]
    fn invalid_values_name_variable_and_value() {
        let cases: &[(&'static str, &'static str)] = &[
            (RANK, "two"),
            (RANK, "-1"),
            (WORLD_SIZE, "0"),
            (WORLD_SIZE, "1.5"),
            (LOCAL_RANK, ""),
            (LOCAL_WORLD_SIZE, "0"),
            (LOCAL_WORLD_SIZE, "9"),
            (MASTER_ADDR, ""),
            (MASTER_ADDR, "bad host"),
            (MASTER_ADDR, "[::1"),
            (MASTER_ADDR, "[127.0.0.1]"),
            (MASTER_PORT, "0"),
            (MASTER_PORT, "65536"),
            (MASTER_PORT, "http"),
        ];
        for &(var, value) in cases {
            match with(&[(var, Some(value))]) {
                Err(EnvError::Invalid {
                    var: v, value: got, ..
                }) => {
                    assert_eq!((v, got.as_str()), (var, value));
                    let msg = with(&[(var, Some(value))]).unwrap_err().to_string();
                    assert!(
                        msg.contains(var) && msg.contains(&format!("{value:?}")),
                        "{msg}"
                    );
                }
                other => panic!("{var}={value:?}: expected Invalid, got {other:?}"),
            }
        }
    }

    #[test]
    fn ranks_out_of_range_are_rejected() {
        assert_eq!(
            with(&[(RANK, Some("8"))]).unwrap_err(),
            EnvError::OutOfRange {
                var: RANK,
                value: 8,
                limit_var: WORLD_SIZE,
                limit: 8
            }
        );
        assert_eq!(
            with(&[(LOCAL_RANK, Some("4"))]).unwrap_err(),
            EnvError::OutOfRange {
                var: LOCAL_RANK,
                value: 4,
                limit_var: LOCAL_WORLD_SIZE,
                limit: 4
            }
        );
        assert_eq!(
            with(&[(LOCAL_RANK, Some("8")), (LOCAL_WORLD_SIZE, None)]).unwrap_err(),
            EnvError::OutOfRange {
                var: LOCAL_RANK,
                value: 8,
                limit_var: WORLD_SIZE,
                limit: 8
            }
        );
    }

    #[test]
    fn job_token_open_flag_job_id_and_listener_are_read() {
        let d = Duration::from_secs(1);
        let c = with(&[
            (EP_JOB_TOKEN, Some("0123456789abcdef0123")),
            (EP_JOB_ID, Some("run-7")),
            (EP_RDZV_LISTEN_FD, Some("5")),
        ])
        .unwrap();
        assert_eq!(
            c.job_token,
            Some(JobToken::new(*b"0123456789abcdef0123").unwrap())
        );
        assert_eq!(
            (c.job_id.as_str(), c.listen_fd, c.open),
            ("run-7", Some(5), false)
        );
        let rc = c.rendezvous_config(d, d);
        assert_eq!(rc.token, c.job_token);
        assert_eq!(rc.job_id, "run-7");
        // The inherited listener is rank 0's only (this is rank 3).
        assert_eq!(rc.inherited_listener, None);
        let c0 = ProcessConfig { rank: 0, ..c };
        assert_eq!(c0.rendezvous_config(d, d).inherited_listener, Some(5));
        // torchrun's run id is the default job id.
        let c = with(&[(TORCHELASTIC_RUN_ID, Some("abc"))]).unwrap();
        assert_eq!(c.job_id, "abc");
        for (v, open) in [("1", true), ("yes", true), ("0", false), ("", false)] {
            assert_eq!(
                with(&[(EP_RDZV_OPEN, Some(v))]).unwrap().open,
                open,
                "{v:?}"
            );
        }
        assert!(matches!(
            with(&[(EP_RDZV_OPEN, Some("maybe"))]),
            Err(EnvError::Invalid {
                var: EP_RDZV_OPEN,
                ..
            })
        ));
        assert!(matches!(
            with(&[(EP_RDZV_LISTEN_FD, Some("-1"))]),
            Err(EnvError::Invalid {
                var: EP_RDZV_LISTEN_FD,
                ..
            })
        ));
    }

    #[test]
    fn a_bad_job_token_is_rejected_without_showing_it() {
        let err = with(&[(EP_JOB_TOKEN, Some("hunter2"))]).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                &err,
                EnvError::Invalid {
                    var: EP_JOB_TOKEN,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            !msg.contains("hunter2") && !format!("{err:?}").contains("hunter2"),
            "{msg}"
        );
        assert!(
            msg.contains("7 bytes") && msg.contains("at least 16"),
            "{msg}"
        );
        // Nor does a parsed configuration print it.
        let c = with(&[(EP_JOB_TOKEN, Some("a-long-enough-secret"))]).unwrap();
        assert!(!format!("{c:?}").contains("a-long-enough-secret"));
    }

    #[test]
    fn non_unicode_value_is_typed() {
        let err = ProcessConfig::from_lookup(|k| {
            if k == RANK {
                Err("\u{fffd}".into())
            } else {
                Ok(GOOD
                    .iter()
                    .find(|(kk, _)| *kk == k)
                    .map(|(_, v)| v.to_string()))
            }
        })
        .unwrap_err();
        assert!(
            matches!(err, EnvError::NotUnicode { var: RANK, .. }),
            "{err:?}"
        );
    }
}
