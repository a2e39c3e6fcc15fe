#!/usr/bin/env python3
"""Write the tokenizer fixture that tl-train's tests load: a tokenizer.json made by another tool.

Trains, with Hugging Face's Python `tokenizers` package, a small BPE of another kind than the
byte-level one `tinyllm tokenizer train` makes: SentencePiece-style (NFKC and lower-casing
normalizers, a Metaspace pre-tokenizer and decoder, `<unk>`, `<s>` and `</s>` special tokens),
on a fixed text written below, and writes

    crates/tl-train/tests/fixtures/python-bpe/tokenizer.json
    crates/tl-train/tests/fixtures/python-bpe/expected.json   the ids (no special tokens
                                                              added) and decoded text of a
                                                              few strings, as Python gives them

The test `tokenizer_fixture` loads the file with the Rust crate and checks the same ids and
text; it needs no Python. Rerun this only to change the fixture:

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers
    /tmp/tokvenv/bin/python scripts/make_tokenizer_fixture.py
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXT = """\
The lazy fox chases two birds near the river. A small dog sleeps under the old tree.
Children like to watch the birds; the birds like to sing in the morning.
Training a model on text needs a tokenizer: it cuts the text into pieces it has seen.
Ｆｕｌｌｗｉｄｔｈ letters are folded by NFKC, and capitals are lower-cased first.
"""

STRINGS = [
    "The lazy fox sleeps.",
    "Birds SING near the old river!",
    "ｆｕｌｌｗｉｄｔｈ and ｃａｐｉｔａｌｓ",
    "unseen words: zebra, quixotic",
    "</s> is the end of a text",
]


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "crates/tl-train/tests/fixtures/python-bpe"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=160,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    expected = []
    for text in STRINGS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        expected.append({"text": text, "ids": ids, "decoded": tokenizer.decode(ids, skip_special_tokens=False)})
    document = {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "strings": expected}
    (out / "expected.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}/tokenizer.json and expected.json ({document['vocab_size']} tokens)")


if __name__ == "__main__":
    main()
