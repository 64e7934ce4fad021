//! The two paths ([`Path`]): which protocol moves a call's data, with its one name and parse.

use std::fmt;
use std::str::FromStr;

use crate::names::{self, UnknownName};

/// Which of the two protocols moves a call's data (docs/contract.md section 6), on every
/// backend: the per-expert reference or the per-destination batches. The same bits either way.
///
/// One name each ([`Path::name`], shown by `Display`): `per-expert` and `batched`, as flags,
/// reports and error messages spell them. The one parse (`FromStr`) takes those names and
/// `per_expert`, the spelling of the Python API's `path=` keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// One message per selection, one signal per (expert, source).
    PerExpert,
    /// One deduplicated batch and one signal per (source, destination).
    Batched,
}

impl Path {
    /// Both paths, the reference first.
    pub const ALL: [Path; 2] = [Path::PerExpert, Path::Batched];

    /// The path's name in flags and reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::PerExpert => "per-expert",
            Path::Batched => "batched",
        }
    }
}

/// Other spellings the parse takes: `per_expert`, the Python API's `path=` keyword since its
/// first release (never shown: every message names [`Path::name`]).
const PATH_ALIASES: [(&str, Path); 1] = [("per_expert", Path::PerExpert)];

impl FromStr for Path {
    type Err = UnknownName;

    /// The path [`Path::name`] (or an alias: `per_expert`) spells `s`.
    fn from_str(s: &str) -> std::result::Result<Path, UnknownName> {
        names::parse_or_alias("path", s, &Path::ALL, Path::name, &PATH_ALIASES)
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_path_has_one_name_and_one_parse() {
        for p in Path::ALL {
            assert_eq!(p.name().parse::<Path>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        assert_eq!(Path::PerExpert.name(), "per-expert");
        // The Python keyword's spelling parses too, and is never shown.
        assert_eq!("per_expert".parse::<Path>(), Ok(Path::PerExpert));
        let e = "per expert".parse::<Path>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"per expert\" is not a path (expected 'per-expert' or 'batched')"
        );
        assert!("Batched".parse::<Path>().is_err());
        // Display pads like a str (report tables align on it).
        assert_eq!(format!("[{:<11}]", Path::Batched), "[batched    ]");
    }
}
