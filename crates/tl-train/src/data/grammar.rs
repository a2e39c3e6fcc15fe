//! [`Grammar`]: a finite probabilistic grammar of sentences, which samples text and knows the
//! exact entropy rate of the byte stream it samples.

use tl_tensor::Generator;

/// One node of a sentence grammar: fixed text, a sequence of nodes, or a weighted choice.
///
/// Built only through its constructors, which check the weights, so every [`Grammar`] holds a
/// proper probability distribution. There is no recursion: the set of sentences is finite,
/// which is what lets a grammar enumerate it.
#[derive(Clone, Debug, PartialEq)]
pub struct Expansion(Node);

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Text(Vec<u8>),
    Seq(Vec<Node>),
    /// Options with probabilities that sum to 1.
    Choice(Vec<(f64, Node)>),
}

impl Expansion {
    /// Fixed text.
    pub fn text(text: &str) -> Self {
        Self(Node::Text(text.as_bytes().to_vec()))
    }

    /// The parts, one after the other.
    pub fn seq(parts: impl IntoIterator<Item = Expansion>) -> Self {
        Self(Node::Seq(parts.into_iter().map(|part| part.0).collect()))
    }

    /// One of the options, drawn with probability proportional to its weight.
    ///
    /// # Panics
    /// If there is no option, or a weight is not finite and positive.
    pub fn choice(options: impl IntoIterator<Item = (f64, Expansion)>) -> Self {
        let options: Vec<(f64, Node)> = options.into_iter().map(|(w, e)| (w, e.0)).collect();
        assert!(!options.is_empty(), "Expansion::choice: no options");
        assert!(
            options.iter().all(|(w, _)| w.is_finite() && *w > 0.0),
            "Expansion::choice: every weight must be finite and positive"
        );
        let total: f64 = options.iter().map(|(w, _)| w).sum();
        Self(Node::Choice(
            options
                .into_iter()
                .map(|(w, node)| (w / total, node))
                .collect(),
        ))
    }

    /// `expansion` with probability `probability`, nothing otherwise.
    ///
    /// # Panics
    /// If `probability` is not strictly between 0 and 1.
    pub fn optional(probability: f64, expansion: Expansion) -> Self {
        assert!(
            probability > 0.0 && probability < 1.0,
            "Expansion::optional: the probability {probability} is not in (0, 1)"
        );
        Self::choice([
            (probability, expansion),
            (1.0 - probability, Self::text("")),
        ])
    }

    /// One of `words`, the k-th (from 1) with probability proportional to `1 / k^exponent`:
    /// Zipf's law, the shape of word frequencies in natural language.
    ///
    /// # Panics
    /// If `words` is empty.
    pub fn zipf(words: &[&str], exponent: f64) -> Self {
        Self::choice(
            words
                .iter()
                .enumerate()
                .map(|(k, word)| ((k as f64 + 1.0).powf(-exponent), Self::text(word))),
        )
    }
}

/// A distribution over sentences, each ending in the only `'\n'` it contains, with its exact
/// statistics.
///
/// # The entropy rate of the sampled text
/// [`generate`](Self::generate) concatenates sentences drawn independently. Splitting the
/// text at each `'\n'` recovers the sentences, so the first `n` sentences and their bytes
/// determine each other and carry the same information, `n · H_S`, where
/// `H_S = −Σ p(s) ln p(s)` runs over the distinct sentence strings `s` (two derivations of one
/// string count as one string with the summed probability). Those `n` sentences fill
/// `n · E[L] + o(n)` bytes (law of large numbers, `E[L] = Σ p(s) len(s)`), and a prefix of the
/// text differs from whole sentences by one partial sentence, whose information is bounded.
/// So the entropy rate of the byte stream, the best loss any model of it can reach, is
///
/// ```text
/// h = H_S / E[L]   nats per byte.
/// ```
///
/// The grammar enumerates every distinct sentence once, when built, to compute it exactly.
///
/// A model that sees only a window of the text averages a little above `h`: the first bytes
/// of a window come without the beginning of their sentence. The excess shrinks as the
/// window grows past a few sentence lengths.
///
/// ```
/// use tl_train::data::{Expansion, Grammar};
/// use tl_tensor::Generator;
/// // "yes.\n" or "no.\n", each half the time: ln 2 nats over a mean of 4.5 bytes.
/// let grammar = Grammar::new(Expansion::seq([
///     Expansion::choice([(1.0, Expansion::text("yes")), (1.0, Expansion::text("no"))]),
///     Expansion::text(".\n"),
/// ]));
/// assert!((grammar.entropy_nats_per_byte() - 2f64.ln() / 4.5).abs() < 1e-15);
/// let text = grammar.generate(&Generator::new(0), 100);
/// assert_eq!(text.len(), 100);
/// ```
#[derive(Clone, Debug)]
pub struct Grammar {
    root: Node,
    distinct_sentences: usize,
    entropy_nats_per_sentence: f64,
    mean_sentence_bytes: f64,
    byte_frequencies: Vec<f64>,
}

impl Grammar {
    /// The grammar of the sentences `root` expands to, with their statistics enumerated.
    ///
    /// Enumeration costs time and memory in proportion to the number of sentences: keep it
    /// to a few hundred thousand.
    ///
    /// # Panics
    /// If some sentence does not end in `'\n'` or contains another `'\n'`: the sentence
    /// boundaries would then not be recoverable from the text, and the entropy rate would not
    /// be `H_S / E[L]`.
    pub fn new(root: Expansion) -> Self {
        let root = root.0;
        let mut sentences = enumerate(&root);
        // Sorting brings the derivations of one string together, so they merge, and fixes
        // the order of the sums below, so the statistics are the same bits on every run.
        sentences.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut merged: Vec<(Vec<u8>, f64)> = Vec::with_capacity(sentences.len());
        for (text, p) in sentences {
            match merged.last_mut() {
                Some((last, q)) if *last == text => *q += p,
                _ => merged.push((text, p)),
            }
        }
        let mut entropy = 0.0;
        let mut mean_bytes = 0.0;
        let mut byte_counts = vec![0.0; 256];
        for (text, p) in &merged {
            let p = *p;
            let newlines = text.iter().filter(|&&b| b == b'\n').count();
            assert!(
                newlines == 1 && text.last() == Some(&b'\n'),
                "Grammar::new: the sentence {:?} must end in the only '\\n' it contains",
                String::from_utf8_lossy(text)
            );
            entropy -= p * p.ln();
            mean_bytes += p * text.len() as f64;
            for &byte in text.iter() {
                byte_counts[usize::from(byte)] += p;
            }
        }
        Self {
            root,
            distinct_sentences: merged.len(),
            entropy_nats_per_sentence: entropy,
            mean_sentence_bytes: mean_bytes,
            byte_frequencies: byte_counts.iter().map(|c| c / mean_bytes).collect(),
        }
    }

    /// How many distinct sentence strings the grammar can produce.
    pub fn distinct_sentences(&self) -> usize {
        self.distinct_sentences
    }

    /// `H_S`: the entropy of one sentence, in nats.
    pub fn entropy_nats_per_sentence(&self) -> f64 {
        self.entropy_nats_per_sentence
    }

    /// `E[L]`: the expected length of a sentence in bytes, its `'\n'` included.
    pub fn mean_sentence_bytes(&self) -> f64 {
        self.mean_sentence_bytes
    }

    /// `H_S / E[L]`: the entropy rate of [`generate`](Self::generate)'s text in nats per
    /// byte, the floor of a language model's cross-entropy loss on it (see the type's doc).
    pub fn entropy_nats_per_byte(&self) -> f64 {
        self.entropy_nats_per_sentence / self.mean_sentence_bytes
    }

    /// The long-run frequency of each byte value (indexed by byte) in the generated text:
    /// `Σ p(s) count_b(s) / E[L]`. They sum to 1.
    pub fn byte_frequencies(&self) -> &[f64] {
        &self.byte_frequencies
    }

    /// One sentence, drawn from `rng` (one uniform draw per choice with several options).
    pub fn sample_sentence(&self, rng: &Generator) -> Vec<u8> {
        let mut out = Vec::new();
        sample_into(&self.root, rng, &mut out);
        out
    }

    /// `n_bytes` of text: independent sentences, one after another, the last one cut off
    /// where the text reaches `n_bytes`. The same generator state gives the same text.
    pub fn generate(&self, rng: &Generator, n_bytes: usize) -> Vec<u8> {
        // Room for the last sentence, which runs past n_bytes before the cut.
        let mut out = Vec::with_capacity(n_bytes + 256);
        while out.len() < n_bytes {
            sample_into(&self.root, rng, &mut out);
        }
        out.truncate(n_bytes);
        out
    }
}

/// Every derivation of `node` with its probability (a string may appear several times).
fn enumerate(node: &Node) -> Vec<(Vec<u8>, f64)> {
    match node {
        Node::Text(text) => vec![(text.clone(), 1.0)],
        Node::Seq(parts) => parts
            .iter()
            .fold(vec![(Vec::new(), 1.0)], |prefixes, part| {
                let suffixes = enumerate(part);
                let mut joined = Vec::with_capacity(prefixes.len() * suffixes.len());
                for (prefix, p) in &prefixes {
                    for (suffix, q) in &suffixes {
                        let mut text = Vec::with_capacity(prefix.len() + suffix.len());
                        text.extend_from_slice(prefix);
                        text.extend_from_slice(suffix);
                        joined.push((text, p * q));
                    }
                }
                joined
            }),
        Node::Choice(options) => options
            .iter()
            .flat_map(|(p, option)| {
                enumerate(option)
                    .into_iter()
                    .map(move |(text, q)| (text, p * q))
            })
            .collect(),
    }
}

fn sample_into(node: &Node, rng: &Generator, out: &mut Vec<u8>) {
    match node {
        Node::Text(text) => out.extend_from_slice(text),
        Node::Seq(parts) => parts.iter().for_each(|part| sample_into(part, rng, out)),
        Node::Choice(options) if options.len() == 1 => sample_into(&options[0].1, rng, out),
        Node::Choice(options) => {
            let u = rng.next_f64();
            let mut cumulative = 0.0;
            // The last option also takes the sliver that rounding leaves above the final sum.
            let chosen = options
                .iter()
                .find(|(p, _)| {
                    cumulative += p;
                    u < cumulative
                })
                .unwrap_or(&options[options.len() - 1]);
            sample_into(&chosen.1, rng, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Expansion {
        Expansion::text(s)
    }

    fn assert_close(actual: f64, expected: f64) {
        assert!((actual - expected).abs() < 1e-12, "{actual} != {expected}");
    }

    #[test]
    fn entropy_rate_of_a_tiny_grammar_matches_the_hand_computation() {
        // "a.\n", "bb.\n", "ccc.\n" with probabilities 1/4, 1/4, 1/2:
        // H_S = 2 · (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2 = 1.0397207708399179 nats,
        // E[L] = 3/4 + 4/4 + 5/2 = 4.25 bytes, h = 1.5 ln 2 / 4.25 = 0.24464018137409832.
        let grammar = Grammar::new(Expansion::seq([
            Expansion::choice([(1.0, text("a")), (1.0, text("bb")), (2.0, text("ccc"))]),
            text(".\n"),
        ]));
        assert_eq!(grammar.distinct_sentences(), 3);
        assert_close(grammar.entropy_nats_per_sentence(), 1.0397207708399179);
        assert_close(grammar.mean_sentence_bytes(), 4.25);
        assert_close(grammar.entropy_nats_per_byte(), 0.24464018137409832);
    }

    #[test]
    fn two_derivations_of_one_string_count_as_one_sentence() {
        // Two optional "a"s: "a\n" arises twice (1/4 + 1/4), "aa\n" and "\n" once each.
        // H_S = (1/2) ln 2 + 2 · (1/4) ln 4 = 1.5 ln 2, E[L] = 3/4 + 2/2 + 1/4 = 2 bytes,
        // h = 0.75 ln 2 = 0.5198603854199589. (Counting derivations would give 2 ln 2 / 2.)
        let grammar = Grammar::new(Expansion::seq([
            Expansion::optional(0.5, text("a")),
            Expansion::optional(0.5, text("a")),
            text("\n"),
        ]));
        assert_eq!(grammar.distinct_sentences(), 3);
        assert_close(grammar.mean_sentence_bytes(), 2.0);
        assert_close(grammar.entropy_nats_per_byte(), 0.5198603854199589);
    }

    #[test]
    fn zipf_probabilities_fall_as_one_over_rank() {
        // Weights 1, 1/2, 1/3 sum to 11/6: p = 6/11, 3/11, 2/11. Each sentence is 2 bytes,
        // so the byte frequencies are half of those, and '\n' is the other half.
        let grammar = Grammar::new(Expansion::seq([
            Expansion::zipf(&["a", "b", "c"], 1.0),
            text("\n"),
        ]));
        let frequencies = grammar.byte_frequencies();
        assert_close(frequencies[usize::from(b'a')], 0.2727272727272727);
        assert_close(frequencies[usize::from(b'b')], 0.13636363636363635);
        assert_close(frequencies[usize::from(b'c')], 0.09090909090909091);
        assert_close(frequencies[usize::from(b'\n')], 0.5);
    }

    #[test]
    fn generated_text_has_the_enumerated_statistics() {
        let grammar = Grammar::default_english();
        let text = grammar.generate(&Generator::new(42), 300_000);
        // Whole sentences only: the last one is cut off.
        let whole = &text[..=text.iter().rposition(|&b| b == b'\n').unwrap()];
        let sentences = whole.iter().filter(|&&b| b == b'\n').count();
        let mean_len = whole.len() as f64 / sentences as f64;
        // About 11,000 sentences with a length spread of a few bytes: a standard error of
        // a few hundredths of a byte.
        let expected_len = grammar.mean_sentence_bytes();
        assert!(
            (mean_len - expected_len).abs() < 0.2,
            "{mean_len} vs {expected_len}"
        );
        let mut counts = [0usize; 256];
        whole.iter().for_each(|&b| counts[usize::from(b)] += 1);
        for (byte, (&count, &expected)) in counts.iter().zip(grammar.byte_frequencies()).enumerate()
        {
            let observed = count as f64 / whole.len() as f64;
            assert!(
                (observed - expected).abs() < 0.004,
                "byte {byte}: {observed} vs {expected}"
            );
            assert!(
                expected > 0.0 || count == 0,
                "byte {byte} is impossible but was drawn"
            );
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_text_and_another_seed_does_not() {
        let grammar = Grammar::default_english();
        let text = grammar.generate(&Generator::new(7), 5_000);
        assert_eq!(text.len(), 5_000);
        assert_eq!(grammar.generate(&Generator::new(7), 5_000), text);
        assert_ne!(grammar.generate(&Generator::new(8), 5_000), text);
        // A shorter text is a prefix: the cut does not change the draws before it.
        assert_eq!(grammar.generate(&Generator::new(7), 1_234), text[..1_234]);
    }

    #[test]
    #[should_panic(expected = "must end in the only '\\n'")]
    fn a_sentence_without_a_final_newline_is_rejected() {
        Grammar::new(Expansion::choice([
            (1.0, text("ok.\n")),
            (1.0, text("no end.")),
        ]));
    }

    #[test]
    #[should_panic(expected = "must end in the only '\\n'")]
    fn a_newline_inside_a_sentence_is_rejected() {
        Grammar::new(text("two\nlines.\n"));
    }

    #[test]
    #[should_panic(expected = "finite and positive")]
    fn a_zero_weight_is_rejected() {
        Expansion::choice([(1.0, text("a\n")), (0.0, text("b\n"))]);
    }
}
