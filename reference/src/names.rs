//! The names of the workspace's choice enums (the path of a call, the dispatch mode,
//! ep-kernels' transport and NCCL sizing): each value has one name, shown to users (CLI flags,
//! reports, JSON, error messages) and parsed back by the enum's `FromStr`, which goes through
//! [`parse`] (or [`parse_or_alias`], for a value that an interface has always spelled another
//! way too), the one parse they share.

/// A name that is none of a choice's values: the `FromStr` error of every choice enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{given:?} is not a {what} (expected {expected})")]
pub struct UnknownName {
    /// What was being named, e.g. "path" or "transport".
    pub what: &'static str,
    /// What was given.
    pub given: String,
    /// The names accepted, quoted, e.g. `'per-expert' or 'batched'`.
    pub expected: String,
}

/// The value of `all` that `name` spells `given`, or [`UnknownName`] listing every name of
/// `all` (in its order). Exact: no other case, no other separator.
pub fn parse<T: Copy>(
    what: &'static str,
    given: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<T, UnknownName> {
    parse_or_alias(what, given, all, name, &[])
}

/// [`parse`], which also takes each of `aliases` (another spelling that some interface has
/// always accepted, e.g. the Python keyword `per_expert`) for its value. The error lists the
/// names only: an alias is accepted, never shown.
pub fn parse_or_alias<T: Copy>(
    what: &'static str,
    given: &str,
    all: &[T],
    name: fn(T) -> &'static str,
    aliases: &[(&str, T)],
) -> Result<T, UnknownName> {
    all.iter()
        .copied()
        .find(|&v| name(v) == given)
        .or_else(|| aliases.iter().find(|a| a.0 == given).map(|a| a.1))
        .ok_or_else(|| UnknownName {
            what,
            given: given.to_string(),
            expected: one_of(all.iter().map(|&v| name(v))),
        })
}

/// `'a'`, `'a' or 'b'`, `'a', 'b' or 'c'`.
fn one_of<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> String {
    let n = names.len();
    let mut s = String::new();
    for (i, name) in names.enumerate() {
        if i > 0 {
            s.push_str(if i + 1 == n { " or " } else { ", " });
        }
        s.push('\'');
        s.push_str(name);
        s.push('\'');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_parses_exactly_and_an_unknown_one_lists_them_all() {
        let all = [1u8, 2, 3];
        let name = |v: u8| ["", "one", "two", "three"][v as usize];
        assert_eq!(parse("number", "two", &all, name), Ok(2));
        for bad in ["Two", "two ", "", "four"] {
            let e = parse("number", bad, &all, name).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("{bad:?} is not a number (expected 'one', 'two' or 'three')")
            );
        }
        assert_eq!(
            parse("number", "x", &all[..2], name).unwrap_err().expected,
            "'one' or 'two'"
        );
        assert_eq!(
            parse("number", "x", &all[..1], name).unwrap_err().expected,
            "'one'"
        );
    }

    #[test]
    fn an_alias_parses_to_its_value_and_is_never_listed() {
        let all = [1u8, 2];
        let name = |v: u8| ["", "one", "two"][v as usize];
        let aliases = [("uno", 1u8)];
        assert_eq!(parse_or_alias("number", "uno", &all, name, &aliases), Ok(1));
        assert_eq!(parse_or_alias("number", "two", &all, name, &aliases), Ok(2));
        let e = parse_or_alias("number", "dos", &all, name, &aliases).unwrap_err();
        assert_eq!(e.expected, "'one' or 'two'");
        assert!(parse("number", "uno", &all, name).is_err());
    }

    #[test]
    fn every_mode_and_path_parses_back_from_its_name() {
        use crate::{Mode, Path};
        for m in Mode::ALL {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
            assert_eq!(m.to_string(), m.name());
        }
        for p in Path::ALL {
            assert_eq!(p.name().parse::<Path>(), Ok(p));
        }
        let e = "fp8+ue8m0".parse::<Mode>().unwrap_err();
        assert_eq!(
            e.expected,
            "'bf16', 'fp8', 'fp8-round-scale' or 'fp8-ue8m0'"
        );
    }
}
