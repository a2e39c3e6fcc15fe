//! Finding the place a pitfall mutates: a function named by its name (or `Type::name` for a
//! method) and a pattern inside its body, matched on the code's tokens rather than its text.
//!
//! An exact text search broke whenever a statement was reformatted or the same text appeared
//! in another function. Here comments are skipped, whitespace between tokens is insignificant
//! (rustfmt may break a line anywhere), and only the named function's body is searched, so a
//! rename or a reformat elsewhere in the file leaves the pitfall where it was. A scanner this
//! small is enough because it need only tell code from comments and literals and pair braces;
//! xtask stays std-only so that it compiles in seconds.

use std::ops::Range;

/// What each byte of a source file is, for the scanner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Code,
    Comment,
    /// Inside a string or character literal (quotes included).
    Literal,
}

/// Classifies every byte of `source`. Handles line and nested block comments, strings with
/// escapes, raw strings (`r#"…"#`) and character literals as opposed to lifetimes.
fn classify(source: &str) -> Vec<Class> {
    let bytes = source.as_bytes();
    let mut classes = vec![Class::Code; bytes.len()];
    let mut i = 0;
    let mark = |classes: &mut Vec<Class>, range: Range<usize>, class| {
        classes[range].iter_mut().for_each(|c| *c = class);
    };
    while i < bytes.len() {
        let rest = &bytes[i..];
        let end = if rest.starts_with(b"//") {
            let len = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            mark(&mut classes, i..i + len, Class::Comment);
            i + len
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < bytes.len() {
                if bytes[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if bytes[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            mark(&mut classes, i..j, Class::Comment);
            j
        } else if let Some(len) = raw_string_len(rest) {
            mark(&mut classes, i..i + len, Class::Literal);
            i + len
        } else if rest[0] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(bytes.len());
            mark(&mut classes, i..end, Class::Literal);
            end
        } else if let Some(len) = char_literal_len(rest) {
            mark(&mut classes, i..i + len, Class::Literal);
            i + len
        } else {
            i + 1
        };
        i = end;
    }
    classes
}

/// The length of the raw string `r#*"…"#*` that `rest` starts with, if it starts with one.
fn raw_string_len(rest: &[u8]) -> Option<usize> {
    let hashes = rest
        .strip_prefix(b"r")?
        .iter()
        .take_while(|&&b| b == b'#')
        .count();
    if rest.get(1 + hashes) != Some(&b'"') {
        return None;
    }
    let closing: Vec<u8> = std::iter::once(b'"').chain(vec![b'#'; hashes]).collect();
    let body = 2 + hashes;
    let len = rest[body..]
        .windows(closing.len())
        .position(|w| w == closing)?;
    Some(body + len + closing.len())
}

/// The length of the character literal `rest` starts with (`'a'`, `'\n'`, `'\u{..}'`), or
/// `None` for a lifetime or anything else.
fn char_literal_len(rest: &[u8]) -> Option<usize> {
    if rest.first() != Some(&b'\'') {
        return None;
    }
    if rest.get(1) == Some(&b'\\') {
        let close = rest[2..].iter().position(|&b| b == b'\'')?;
        return Some(2 + close + 1);
    }
    let width = match rest.get(1)? {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    };
    (rest.get(1 + width) == Some(&b'\'')).then_some(1 + width + 1)
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The positions where the word `word` occurs as code, not inside a longer identifier.
fn code_words<'a>(
    source: &'a str,
    classes: &'a [Class],
    word: &'a str,
) -> impl Iterator<Item = usize> + 'a {
    let bytes = source.as_bytes();
    source
        .match_indices(word)
        .map(|(at, _)| at)
        .filter(move |&at| {
            let end = at + word.len();
            classes[at] == Class::Code
                && (at == 0 || !is_ident_byte(bytes[at - 1]))
                && (end == bytes.len() || !is_ident_byte(bytes[end]))
        })
}

/// The byte range `{ … }` of the first block that opens at or after `from`.
fn block_from(source: &str, classes: &[Class], from: usize) -> Option<Range<usize>> {
    let bytes = source.as_bytes();
    let open = (from..bytes.len()).find(|&i| classes[i] == Class::Code && bytes[i] == b'{')?;
    let mut depth = 0usize;
    for i in open..bytes.len() {
        if classes[i] != Class::Code {
            continue;
        }
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open..i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether the `impl` block whose header is `header` (from `impl` to its `{`) is for `ty`.
fn implements(header: &str, ty: &str) -> bool {
    let header = header.split(" where").next().unwrap_or(header);
    let self_type = header.rsplit(" for ").next().unwrap_or(header);
    self_type
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|word| word == ty)
}

/// The body of the function `function` (`name`, or `Type::name` for a method of an `impl`
/// block for `Type`) in `source`.
///
/// # Errors
///
/// When no function or more than one function of that name is found.
pub(crate) fn function_body(source: &str, function: &str) -> Result<Range<usize>, String> {
    let classes = classify(source);
    let (ty, name) = match function.rsplit_once("::") {
        Some((ty, name)) => (Some(ty), name),
        None => (None, function),
    };
    let impls: Vec<(Range<usize>, &str)> = code_words(source, &classes, "impl")
        .filter_map(|at| {
            let block = block_from(source, &classes, at)?;
            Some((block.clone(), &source[at..block.start]))
        })
        .collect();
    let bodies: Vec<Range<usize>> = code_words(source, &classes, "fn")
        .filter(|&at| {
            let rest = source[at + 2..].trim_start();
            rest.strip_prefix(name)
                .is_some_and(|after| after.trim_start().starts_with(['(', '<']))
        })
        .filter(|&at| {
            let enclosing = impls
                .iter()
                .filter(|(block, _)| block.contains(&at))
                .min_by_key(|(block, _)| block.len());
            match (ty, enclosing) {
                (Some(ty), Some((_, header))) => implements(header, ty),
                (Some(_), None) => false,
                (None, _) => true,
            }
        })
        .filter_map(|at| block_from(source, &classes, at))
        .collect();
    match bodies.as_slice() {
        [body] => Ok(body.clone()),
        [] => Err(format!("no function {function}")),
        _ => Err(format!("{} functions named {function}", bodies.len())),
    }
}

/// The byte ranges of `range` in `source` that match `pattern`, comments skipped and
/// whitespace between tokens ignored (so `pattern` should not rely on spaces inside a
/// string literal).
fn matches_in(source: &str, range: Range<usize>, pattern: &str) -> Vec<Range<usize>> {
    let classes = classify(source);
    let bytes = source.as_bytes();
    let kept: Vec<usize> = range
        .filter(|&i| match classes[i] {
            Class::Comment => false,
            Class::Code => !bytes[i].is_ascii_whitespace(),
            Class::Literal => true,
        })
        .collect();
    let squeezed: Vec<u8> = kept.iter().map(|&i| bytes[i]).collect();
    let wanted: Vec<u8> = pattern
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    squeezed
        .windows(wanted.len())
        .enumerate()
        .filter(|(_, window)| *window == wanted.as_slice())
        .map(|(start, _)| kept[start]..kept[start + wanted.len() - 1] + 1)
        .collect()
}

/// The one place in `source` where `pattern` occurs inside `function`.
///
/// # Errors
///
/// When the function is not found exactly once, or the pattern not exactly once inside it.
pub(crate) fn locate(source: &str, function: &str, pattern: &str) -> Result<Range<usize>, String> {
    let body = function_body(source, function)?;
    match matches_in(source, body, pattern).as_slice() {
        [site] => Ok(site.clone()),
        sites => Err(format!(
            "`{pattern}` found {} times in {function}",
            sites.len()
        )),
    }
}

/// `source` with the one occurrence of `pattern` inside `function` replaced by `replacement`.
///
/// # Errors
///
/// As [`locate`].
pub(crate) fn replace_in(
    source: &str,
    function: &str,
    pattern: &str,
    replacement: &str,
) -> Result<String, String> {
    let site = locate(source, function, pattern)?;
    Ok(format!(
        "{}{replacement}{}",
        &source[..site.start],
        &source[site.end..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = r#"
struct Guard;
impl Drop for Guard {
    fn drop(&mut self) {
        // restore(previous); in a comment does not count
        restore(
            previous,
        );
    }
}
impl<T: Clone> Other<T> {
    fn drop(&self) { restore(previous); let s = "{ not a brace"; let c = '}'; }
}
fn free<'a>(x: &'a str) -> &'a str { /* restore(previous); */ x }
"#;

    #[test]
    fn a_reformatted_statement_in_the_named_method_matches_once() {
        let site = locate(SOURCE, "Guard::drop", "restore(previous,);").unwrap();
        assert!(SOURCE[site.clone()].starts_with("restore(\n"));
        assert!(SOURCE[site].ends_with(");"));
        let mutated = replace_in(SOURCE, "Guard::drop", "restore(previous,);", "bug();").unwrap();
        assert!(mutated.contains("bug();") && mutated.contains("fn drop(&self) { restore"));
    }

    #[test]
    fn methods_are_told_apart_by_their_impl_and_literals_do_not_pair_braces() {
        assert!(locate(SOURCE, "Other::drop", "restore(previous);").is_ok());
        assert!(
            function_body(SOURCE, "drop")
                .unwrap_err()
                .contains("2 functions")
        );
        let free = function_body(SOURCE, "free").unwrap();
        assert_eq!(&SOURCE[free.clone()], "{ /* restore(previous); */ x }");
        assert!(locate(SOURCE, "free", "restore(previous);").is_err());
        assert!(locate(SOURCE, "Guard::free", "x").is_err());
    }
}
