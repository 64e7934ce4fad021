//! Our two keywords, `path=` and `transport=`, parsed as the enums spell them: one parse each,
//! an `ArgumentError` naming the keyword otherwise.
//!
//! - `path=`: `'per_expert'` (the Python API's spelling since its first release) or
//!   `'per-expert'`, and `'batched'`: `Path`'s one parse, which takes both spellings; messages
//!   name the path [`Path::name`]'s way (`'per-expert'`);
//! - `transport=`: `'auto'`, `'nccl'` or `'two-tier'`, [`Transport::name`] (the one spelling
//!   the flags and reports use too).

use crate::error::{BindError, Result};
use ep_kernels::Transport;
use ep_reference::Path;

/// Parses our `path=` keyword.
pub fn path(keyword: &str) -> Result<Path> {
    keyword
        .parse()
        .map_err(|e: ep_reference::UnknownName| BindError::argument("path", e.to_string()))
}

/// Parses our `transport=` keyword.
pub fn transport(keyword: &str) -> Result<Transport> {
    keyword
        .parse()
        .map_err(|e: ep_reference::UnknownName| BindError::argument("transport", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keywords_parse_or_name_the_argument() {
        assert_eq!(path("batched").unwrap(), Path::Batched);
        assert_eq!(path("per_expert").unwrap(), Path::PerExpert);
        for p in Path::ALL {
            assert_eq!(path(p.name()).unwrap(), p);
        }
        for t in Transport::ALL {
            assert_eq!(transport(t.name()).unwrap(), t);
        }
        assert_eq!(transport("two-tier").unwrap(), Transport::TwoTier);
        for bad in ["fast", "per expert", "Batched", ""] {
            let e = path(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "argument `path`: {bad:?} is not a path (expected 'per-expert' or 'batched')"
                )
            );
        }
        for bad in ["ib", "two_tier", "NCCL", ""] {
            let e = transport(bad).unwrap_err().to_string();
            assert!(e.starts_with("argument `transport`"), "{e}");
            assert!(e.contains("'auto', 'nccl' or 'two-tier'"), "{e}");
        }
    }
}
