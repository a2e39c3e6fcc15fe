//! The built-in corpus's grammar: simple English sentences with number agreement.

use std::sync::OnceLock;

use super::grammar::{Expansion, Grammar};

/// Word frequencies fall as `1 / rank`, as in natural language.
const ZIPF_EXPONENT: f64 = 1.0;

/// A subject or object in the singular and in the plural: the same things, two spellings.
struct Number {
    subject_determiners: &'static [&'static str],
    object_determiners: &'static [&'static str],
    nouns: &'static [&'static str],
    transitive_verbs: &'static [&'static str],
    intransitive_verbs: &'static [&'static str],
}

// Every noun and adjective starts with a consonant, so "a" is always the right article.
const SINGULAR: Number = Number {
    subject_determiners: &["The", "A", "This"],
    object_determiners: &["the", "a", "this"],
    nouns: &["dog", "cat", "bird", "fox", "child", "mouse"],
    transitive_verbs: &["sees", "chases", "likes", "finds", "watches"],
    intransitive_verbs: &["runs", "sleeps", "sings", "waits"],
};

const PLURAL: Number = Number {
    subject_determiners: &["The", "Two", "Some"],
    object_determiners: &["the", "two", "some"],
    nouns: &["dogs", "cats", "birds", "foxes", "children", "mice"],
    transitive_verbs: &["see", "chase", "like", "find", "watch"],
    intransitive_verbs: &["run", "sleep", "sing", "wait"],
};

const ADJECTIVES: &[&str] = &["small", "big", "red", "lazy", "happy"];
const PREPOSITIONS: &[&str] = &["near", "under", "behind"];
const PLACES: &[&str] = &["tree", "house", "river", "park"];

/// How often a noun phrase is singular, has an adjective, a verb takes an object, and an
/// intransitive verb is followed by a place.
const P_SINGULAR: f64 = 0.6;
const P_ADJECTIVE: f64 = 0.5;
const P_TRANSITIVE: f64 = 0.6;
const P_PLACE: f64 = 0.5;

fn zipf(words: &[&str]) -> Expansion {
    Expansion::zipf(words, ZIPF_EXPONENT)
}

/// "the small dog", "two mice".
fn noun_phrase(determiners: &[&str], number: &Number) -> Expansion {
    Expansion::seq([
        zipf(determiners),
        Expansion::text(" "),
        Expansion::optional(
            P_ADJECTIVE,
            Expansion::seq([zipf(ADJECTIVES), Expansion::text(" ")]),
        ),
        zipf(number.nouns),
    ])
}

/// An object in either number, whatever the subject's.
fn object() -> Expansion {
    Expansion::choice([
        (
            P_SINGULAR,
            noun_phrase(SINGULAR.object_determiners, &SINGULAR),
        ),
        (
            1.0 - P_SINGULAR,
            noun_phrase(PLURAL.object_determiners, &PLURAL),
        ),
    ])
}

/// A sentence whose verb agrees with its subject's number.
fn sentence(number: &Number) -> Expansion {
    let place = Expansion::seq([
        Expansion::text(" "),
        zipf(PREPOSITIONS),
        Expansion::text(" the "),
        zipf(PLACES),
    ]);
    let predicate = Expansion::choice([
        (
            P_TRANSITIVE,
            Expansion::seq([
                zipf(number.transitive_verbs),
                Expansion::text(" "),
                object(),
            ]),
        ),
        (
            1.0 - P_TRANSITIVE,
            Expansion::seq([
                zipf(number.intransitive_verbs),
                Expansion::optional(P_PLACE, place),
            ]),
        ),
    ]);
    Expansion::seq([
        noun_phrase(number.subject_determiners, number),
        Expansion::text(" "),
        predicate,
        Expansion::text(".\n"),
    ])
}

impl Grammar {
    /// The grammar of the built-in corpus: short English sentences such as
    /// "The small dog chases two mice.\n" or "Some cats sleep near the tree.\n".
    ///
    /// A subject (singular or plural, with an optional adjective) is followed by a verb that
    /// agrees with it in number, then either an object of either number or an optional place.
    /// Every word class follows Zipf's law. Spelling is deterministic once a word is chosen,
    /// so most bytes are predictable and the entropy rate is low, but the choices between
    /// words are real, and agreement asks a model to look back at the subject.
    ///
    /// ```
    /// use tl_train::data::Grammar;
    /// let grammar = Grammar::default_english();
    /// let h = grammar.entropy_nats_per_byte();
    /// assert!(0.3 < h && h < 1.5);
    /// ```
    pub fn default_english() -> Self {
        // Enumerating its sentences takes a noticeable fraction of a second: do it once.
        static DEFAULT: OnceLock<Grammar> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                Grammar::new(Expansion::choice([
                    (P_SINGULAR, sentence(&SINGULAR)),
                    (1.0 - P_SINGULAR, sentence(&PLURAL)),
                ]))
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use tl_tensor::Generator;

    use super::*;

    #[test]
    fn default_grammar_statistics_are_pinned() {
        let grammar = Grammar::default_english();
        // 2 subject numbers × 3 determiners × (1 + 5 adjectives) × 6 nouns = 216 subjects;
        // 5 verbs × 216 objects + 4 verbs × (1 + 3 × 4 places) = 1132 predicates per number.
        assert_eq!(grammar.distinct_sentences(), 216 * 1132);
        let pinned = [
            (grammar.entropy_nats_per_sentence(), 10.206039614051203),
            (grammar.mean_sentence_bytes(), 27.57903306564694),
            (grammar.entropy_nats_per_byte(), 0.3700651719644252),
        ];
        for (actual, expected) in pinned {
            assert!(
                (actual - expected).abs() < 1e-12 * expected,
                "{actual} != {expected}"
            );
        }
    }

    #[test]
    fn verbs_and_determiners_agree_with_the_subject() {
        let grammar = Grammar::default_english();
        let rng = Generator::new(3);
        let mut seen = [false; 2];
        for _ in 0..400 {
            let sentence = String::from_utf8(grammar.sample_sentence(&rng)).unwrap();
            let words: Vec<&str> = sentence.strip_suffix(".\n").unwrap().split(' ').collect();
            let noun_at = if ADJECTIVES.contains(&words[1]) { 2 } else { 1 };
            let (determiner, noun, verb) = (words[0], words[noun_at], words[noun_at + 1]);
            for (index, number) in [SINGULAR, PLURAL].iter().enumerate() {
                if number.nouns.contains(&noun) {
                    seen[index] = true;
                    assert!(
                        number.subject_determiners.contains(&determiner),
                        "{sentence}"
                    );
                    let verbs = [number.transitive_verbs, number.intransitive_verbs].concat();
                    assert!(verbs.contains(&verb), "{sentence}");
                }
            }
        }
        assert_eq!(seen, [true, true]);
    }
}
