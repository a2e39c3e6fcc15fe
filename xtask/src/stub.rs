//! Turns a reference source file into the learner's stub: the same public contract (types,
//! signatures, doc comments), every body a `todo!` naming the function, no private helpers
//! and no tests.
//!
//! The harness is std only, so this is a small Rust lexer rather than a parser: it knows
//! comments, string, char and raw-string literals, lifetimes and bracket groups, which is
//! what it takes to find where each item starts and ends. Items are read at the file's top
//! level and inside `mod`, `impl` and `trait` blocks:
//!
//! - an item marked `#[cfg(test)]` goes (the reference's own tests are not the learner's);
//! - a function with a body keeps its attributes, doc comment and signature, and its body
//!   becomes `todo!("L11.1: NAME — see GUIDE")` (a `panic!` in a `const fn`), when it is
//!   part of the contract or other modules use it: `pub` (also `pub(crate)`), a method of a
//!   trait impl, or a trait's provided method;
//! - any other function (a private helper) goes, with its doc comment: how to split the
//!   work is the learner's to decide;
//! - everything else (types, traits, constants, `use`, thread-locals) stays as it is.

use std::ops::Range;

/// A token's kind, as far as finding items needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ident,
    Punct(u8),
    Open(u8),
    Close(u8),
    Literal,
    Lifetime,
}

#[derive(Clone, Copy, Debug)]
struct Token {
    kind: Kind,
    span: (usize, usize),
}

/// Splits `src` into tokens, dropping whitespace and comments (doc comments included: they
/// travel with the item they precede, by position).
fn lex(src: &str) -> Result<Vec<Token>, String> {
    let bytes = src.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    let error = |at: usize, what: &str| {
        let line = src[..at].lines().count().max(1);
        format!("line {line}: {what}")
    };
    while i < bytes.len() {
        let c = bytes[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if src[i..].starts_with("//") {
            i = src[i..].find('\n').map_or(bytes.len(), |n| i + n);
            continue;
        }
        if src[i..].starts_with("/*") {
            let mut depth = 0;
            while i < bytes.len() {
                if src[i..].starts_with("/*") {
                    depth += 1;
                    i += 2;
                } else if src[i..].starts_with("*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            if depth != 0 {
                return Err(error(start, "unterminated block comment"));
            }
            continue;
        }
        // Raw strings: r"..", r#".."#, br#".."#, cr".."
        let raw_prefix = ["br", "cr", "r"].iter().find(|p| {
            src[i..].starts_with(**p)
                && matches!(bytes.get(i + p.len()), Some(b'"') | Some(b'#'))
                && (i == 0 || !is_ident_byte(bytes[i - 1]))
        });
        if let Some(prefix) = raw_prefix {
            let mut j = i + prefix.len();
            let hashes = bytes[j..].iter().take_while(|&&b| b == b'#').count();
            j += hashes;
            if bytes.get(j) == Some(&b'"') {
                let close = format!("\"{}", "#".repeat(hashes));
                let end = src[j + 1..]
                    .find(&close)
                    .ok_or_else(|| error(start, "unterminated raw string"))?;
                i = j + 1 + end + close.len();
                tokens.push(Token {
                    kind: Kind::Literal,
                    span: (start, i),
                });
                continue;
            }
        }
        if c == b'"' || (matches!(c, b'b' | b'c') && bytes.get(i + 1) == Some(&b'"')) {
            i += if c == b'"' { 1 } else { 2 };
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            if i >= bytes.len() {
                return Err(error(start, "unterminated string"));
            }
            i += 1;
            tokens.push(Token {
                kind: Kind::Literal,
                span: (start, i),
            });
            continue;
        }
        if c == b'\'' || (c == b'b' && bytes.get(i + 1) == Some(&b'\'')) {
            let j = if c == b'\'' { i + 1 } else { i + 2 };
            if bytes.get(j) == Some(&b'\\') {
                // An escaped char: '\n', '\'', '\u{..}'.
                let end = src[j + 2..]
                    .find('\'')
                    .ok_or_else(|| error(start, "unterminated char"))?;
                i = j + 2 + end + 1;
                tokens.push(Token {
                    kind: Kind::Literal,
                    span: (start, i),
                });
                continue;
            }
            let next = src[j..].chars().next().map_or(0, char::len_utf8);
            if bytes.get(j + next) == Some(&b'\'') {
                i = j + next + 1;
                tokens.push(Token {
                    kind: Kind::Literal,
                    span: (start, i),
                });
                continue;
            }
            // A lifetime or a label.
            i = j;
            while i < bytes.len() && is_ident_byte(bytes[i]) {
                i += 1;
            }
            tokens.push(Token {
                kind: Kind::Lifetime,
                span: (start, i),
            });
            continue;
        }
        if is_ident_byte(c) {
            while i < bytes.len() && is_ident_byte(bytes[i]) {
                i += 1;
            }
            tokens.push(Token {
                kind: if c.is_ascii_digit() {
                    Kind::Literal
                } else {
                    Kind::Ident
                },
                span: (start, i),
            });
            continue;
        }
        if !c.is_ascii() {
            // Only inside literals and comments in this code; elsewhere, a symbol to skip.
            i += src[i..].chars().next().map_or(1, char::len_utf8);
            continue;
        }
        i += 1;
        let kind = match c {
            b'(' | b'[' | b'{' => Kind::Open(c),
            b')' | b']' | b'}' => Kind::Close(c),
            _ => Kind::Punct(c),
        };
        tokens.push(Token {
            kind,
            span: (start, i),
        });
    }
    Ok(tokens)
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Where to send the learner for the function in this file.
pub(crate) struct StubContext<'a> {
    /// The chapter, `L11.1`.
    pub(crate) module: &'a str,
    /// The guide to read, `docs/mixed-precision.md`.
    pub(crate) guide: &'a str,
}

/// One change to the source: replace `range` by `with`.
struct Edit {
    range: Range<usize>,
    with: String,
}

/// What kind of block the items being read sit in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// A file or a `mod` block: free functions.
    Module,
    /// `impl Type { .. }`.
    Inherent,
    /// `impl Trait for Type { .. }`: every method is the trait's.
    TraitImpl,
    /// `trait Name { .. }`: provided methods are the contract.
    Trait,
}

/// The stub of `src` (see the module's documentation).
///
/// # Errors
/// A message with a line number when the source cannot be lexed or its brackets do not
/// match.
pub(crate) fn stub_source(src: &str, context: &StubContext<'_>) -> Result<String, String> {
    let tokens = lex(src)?;
    let mut edits = Vec::new();
    items(
        src,
        &tokens,
        0,
        tokens.len(),
        Scope::Module,
        context,
        &mut edits,
    )?;
    edits.sort_by_key(|edit| edit.range.start);
    let mut out = String::with_capacity(src.len());
    let mut at = 0;
    for edit in edits {
        out.push_str(&src[at..edit.range.start]);
        out.push_str(&edit.with);
        at = edit.range.end;
    }
    out.push_str(&src[at..]);
    Ok(tidy_blank_lines(&out))
}

/// The index of the token that closes the group opened at `open`.
fn matching(tokens: &[Token], open: usize) -> Result<usize, String> {
    let mut depth = 0usize;
    for (i, token) in tokens.iter().enumerate().skip(open) {
        match token.kind {
            Kind::Open(_) => depth += 1,
            Kind::Close(_) => {
                depth -= 1;
                if depth == 0 {
                    return Ok(i);
                }
            }
            _ => {}
        }
    }
    Err("unbalanced brackets".into())
}

fn text<'s>(src: &'s str, token: &Token) -> &'s str {
    &src[token.span.0..token.span.1]
}

/// Reads the items of `tokens[from..to]` in `scope`, recording edits.
fn items(
    src: &str,
    tokens: &[Token],
    from: usize,
    to: usize,
    scope: Scope,
    context: &StubContext<'_>,
    edits: &mut Vec<Edit>,
) -> Result<(), String> {
    let mut start = from;
    let mut i = from;
    // The item's start in the source: after the previous item's end (so its doc comment
    // and attributes come with it).
    let mut item_src_start = if from == 0 {
        0
    } else {
        tokens[from - 1].span.1
    };
    while i < to {
        let token = tokens[i];
        let ends_here = match token.kind {
            Kind::Punct(b';') => Some(i),
            Kind::Open(b'{') => {
                let words: Vec<&str> = tokens[start..i]
                    .iter()
                    .filter(|t| t.kind == Kind::Ident)
                    .map(|t| text(src, t))
                    .collect();
                let is_value = !words.contains(&"fn")
                    && words
                        .iter()
                        .any(|w| matches!(*w, "const" | "static" | "type" | "use" | "let"));
                if is_value {
                    i = matching(tokens, i)? + 1;
                    continue;
                }
                Some(matching(tokens, i)?)
            }
            Kind::Open(_) => {
                i = matching(tokens, i)? + 1;
                continue;
            }
            _ => None,
        };
        let Some(end) = ends_here else {
            i += 1;
            continue;
        };
        item(
            src,
            tokens,
            start,
            end,
            item_src_start,
            scope,
            context,
            edits,
        )?;
        item_src_start = tokens[end].span.1;
        start = end + 1;
        i = end + 1;
    }
    Ok(())
}

/// Handles the item `tokens[start..=end]`, which begins in the source at `src_start`.
#[allow(clippy::too_many_arguments)]
fn item(
    src: &str,
    tokens: &[Token],
    start: usize,
    end: usize,
    src_start: usize,
    scope: Scope,
    context: &StubContext<'_>,
    edits: &mut Vec<Edit>,
) -> Result<(), String> {
    // Outer attributes first: `#[..]` (not `#![..]`, which belongs to the enclosing block).
    let mut head = start;
    let mut cfg_test = false;
    while head < end
        && tokens[head].kind == Kind::Punct(b'#')
        && tokens[head + 1].kind == Kind::Open(b'[')
    {
        let close = matching(tokens, head + 1)?;
        let attribute: String = tokens[head + 2..close]
            .iter()
            .map(|t| text(src, t))
            .collect();
        cfg_test |= attribute == "cfg(test)";
        head = close + 1;
    }
    let whole = line_start(src, src_start)..line_end(src, tokens[end].span.1);
    if cfg_test {
        edits.push(Edit {
            range: whole,
            with: String::new(),
        });
        return Ok(());
    }
    let words: Vec<(usize, &str)> = (head..=end)
        .filter(|&k| tokens[k].kind == Kind::Ident)
        .map(|k| (k, text(src, &tokens[k])))
        .collect();
    let first_brace = (head..=end).find(|&k| tokens[k].kind == Kind::Open(b'{'));
    let fn_at = words.iter().find(|(_, w)| *w == "fn").map(|&(k, _)| k);
    if let (Some(fn_at), Some(body)) = (fn_at, first_brace)
        && body > fn_at
        && !words
            .iter()
            .any(|(k, w)| *k < fn_at && matches!(*w, "impl" | "trait" | "mod"))
    {
        // `pub(crate)` and the like count too: other modules import them.
        let visible = words.first().is_some_and(|(_, w)| *w == "pub");
        let keep = visible || matches!(scope, Scope::TraitImpl | Scope::Trait);
        if keep {
            let name = text(src, &tokens[fn_at + 1]);
            let indent = indentation(src, tokens[fn_at].span.0);
            let message = format!("{}: {name} — see {}", context.module, context.guide);
            // A `const fn` may panic with a literal only (`todo!` formats).
            let is_const = words.iter().any(|(k, w)| *k < fn_at && *w == "const");
            let body_text = if is_const {
                format!("panic!(\"not yet implemented: {message}\")")
            } else {
                format!("todo!(\"{message}\")")
            };
            edits.push(Edit {
                range: tokens[body].span.1..tokens[end].span.0,
                with: format!("\n{indent}    {body_text}\n{indent}"),
            });
        } else {
            edits.push(Edit {
                range: whole,
                with: String::new(),
            });
        }
        return Ok(());
    }
    // A block of items: recurse.
    if let Some(body) = first_brace {
        let kind = words
            .iter()
            .find(|(k, w)| *k < body && matches!(*w, "impl" | "trait" | "mod"))
            .map(|(_, w)| *w);
        let inner = match kind {
            Some("mod") => Some(Scope::Module),
            Some("trait") => Some(Scope::Trait),
            Some("impl") => {
                let is_trait_impl = (head..body).any(|k| {
                    text(src, &tokens[k]) == "for"
                        && tokens.get(k + 1).map(|t| t.kind) != Some(Kind::Punct(b'<'))
                });
                Some(if is_trait_impl {
                    Scope::TraitImpl
                } else {
                    Scope::Inherent
                })
            }
            _ => None,
        };
        if let Some(inner) = inner {
            items(src, tokens, body + 1, end, inner, context, edits)?;
        }
    }
    Ok(())
}

/// The offset of the start of the line holding `at`, or of the next line when only blanks
/// separate `at` from it (the item's own lines, not the end of the previous item's).
fn line_start(src: &str, at: usize) -> usize {
    match src[at..].find(|c: char| !c.is_whitespace()) {
        Some(n) => {
            let first = at + n;
            src[..first].rfind('\n').map_or(0, |k| k + 1)
        }
        None => at,
    }
}

/// The offset just past the newline that ends the line holding `at`.
fn line_end(src: &str, at: usize) -> usize {
    src[at..].find('\n').map_or(src.len(), |n| at + n + 1)
}

/// The whitespace that begins the line holding `at`.
fn indentation(src: &str, at: usize) -> &str {
    let start = src[..at].rfind('\n').map_or(0, |k| k + 1);
    let line = &src[start..];
    &line[..line.len() - line.trim_start().len()]
}

/// No more than one blank line in a row (removed items leave gaps), and none before a
/// closing brace.
fn tidy_blank_lines(src: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for line in src.lines() {
        let blank = line.trim().is_empty();
        if blank && out.last().is_some_and(|l: &&str| l.trim().is_empty()) {
            continue;
        }
        if line.trim_start().starts_with('}') && out.last().is_some_and(|l| l.trim().is_empty()) {
            out.pop();
        }
        out.push(line);
    }
    let mut text = out.join("\n");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTEXT: StubContext<'static> = StubContext {
        module: "L11.1",
        guide: "docs/g.md",
    };

    fn stub(src: &str) -> String {
        stub_source(src, &CONTEXT).unwrap()
    }

    #[test]
    fn public_functions_keep_their_docs_and_signatures_and_lose_their_bodies() {
        let src = "/// Adds one.\n///\n/// ```\n/// assert_eq!(f(1), 2);\n/// ```\npub fn f(x: u32) -> u32 {\n    let y = x + 1; // '{'\n    y\n}\n";
        assert_eq!(
            stub(src),
            "/// Adds one.\n///\n/// ```\n/// assert_eq!(f(1), 2);\n/// ```\npub fn f(x: u32) -> u32 {\n    todo!(\"L11.1: f — see docs/g.md\")\n}\n"
        );
    }

    #[test]
    fn private_helpers_and_tests_go_and_types_stay() {
        let src = r##"use std::fmt;

/// A thing.
pub struct Thing<'a> {
    name: &'a str,
}

/// Helper: how it is split is the learner's call.
fn helper(c: char) -> bool {
    c == '}' || c == '\''
}

pub(crate) fn internal() -> u8 {
    7
}

pub const fn limit() -> u8 {
    8
}

impl<'a> Thing<'a> {
    /// Makes one.
    pub fn new(name: &'a str) -> Self {
        Self { name }
    }

    fn private(&self) -> &str {
        r#"}"#
    }
}

impl fmt::Display for Thing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)
    }
}

const LIMIT: Thing<'static> = Thing { name: "x" };

#[cfg(test)]
mod tests {
    #[test]
    fn t() {}
}
"##;
        let out = stub(src);
        assert!(
            out.contains("pub struct Thing<'a> {\n    name: &'a str,\n}"),
            "{out}"
        );
        assert!(!out.contains("helper"), "{out}");
        // Other modules may import a pub(crate) function: it stays, stubbed.
        assert!(
            out.contains("pub(crate) fn internal() -> u8 {\n    todo!(\"L11.1: internal"),
            "{out}"
        );
        assert!(
            out.contains(
                "pub const fn limit() -> u8 {\n    panic!(\"not yet implemented: L11.1: limit"
            ),
            "{out}"
        );
        assert!(
            !out.contains("fn private") && !out.contains("mod tests"),
            "{out}"
        );
        assert!(out.contains("    pub fn new(name: &'a str) -> Self {\n        todo!(\"L11.1: new — see docs/g.md\")\n    }"), "{out}");
        assert!(out.contains("fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {\n        todo!(\"L11.1: fmt"), "{out}");
        assert!(
            out.contains("const LIMIT: Thing<'static> = Thing { name: \"x\" };"),
            "{out}"
        );
        assert!(!out.contains("\n\n\n"), "{out}");
    }

    #[test]
    fn provided_trait_methods_are_stubbed_and_required_ones_stay_declarations() {
        let src = "pub trait Obs {\n    /// Required.\n    fn need(&mut self);\n    /// Provided.\n    fn given(&mut self) -> bool {\n        true\n    }\n}\n";
        let out = stub(src);
        assert!(out.contains("    fn need(&mut self);\n"), "{out}");
        assert!(
            out.contains("    fn given(&mut self) -> bool {\n        todo!(\"L11.1: given"),
            "{out}"
        );
    }

    #[test]
    fn unbalanced_or_unterminated_sources_are_errors_with_a_line() {
        assert!(stub_source("pub fn f() {\n", &CONTEXT).is_err());
        let error = stub_source("fn f() {}\nconst S: &str = \"open;\n", &CONTEXT).unwrap_err();
        assert!(error.starts_with("line 2"), "{error}");
    }
}
