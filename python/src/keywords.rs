//! Our two keywords, `path=` and `transport=`, parsed as the enums spell them: one parse each,
//! an `ArgumentError` naming the keyword otherwise.
//!
//! - `path=`: `'per_expert'` or `'batched'`, [`Path::python_keyword`] (the Python API's
//!   spelling since its first release, kept so that no caller breaks; `'per-expert'`, the name
//!   flags and reports use, is refused with the keyword's own spellings listed);
//! - `transport=`: `'auto'`, `'nccl'` or `'two-tier'`, [`Transport::name`] (the one spelling
//!   the flags and reports use too).

use crate::error::{BindError, Result};
use ep_kernels::Transport;
use ep_reference::Path;

/// Parses our `path=` keyword.
pub fn path(keyword: &str) -> Result<Path> {
    Path::from_python_keyword(keyword).map_err(|e| BindError::argument("path", e.to_string()))
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
            assert_eq!(path(p.python_keyword()).unwrap(), p);
        }
        for t in Transport::ALL {
            assert_eq!(transport(t.name()).unwrap(), t);
        }
        assert_eq!(transport("two-tier").unwrap(), Transport::TwoTier);
        for bad in ["fast", "per-expert", "Batched", ""] {
            let e = path(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "argument `path`: {bad:?} is not a path (expected 'per_expert' or 'batched')"
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
