#!/usr/bin/env python3
"""Write The Rust Programming Language, as shipped with the Rust toolchain, as plain text.

Real English at hand on any machine with rustup's docs: every chapter of the book
(`share/doc/rust/html/book/ch*.html` and the appendices) becomes one `.txt` file of its
main text, code listings included, navigation and scripts left out. The closing run of
docs/data.md trains on it:

    python3 scripts/rust_book_corpus.py --out corpus/rust-book
    tinyllm tokenizer train --data corpus/rust-book --vocab-size 8192 --out bpe-8k.json

Standard library only.
"""

import argparse
import glob
import html
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path


class MainText(HTMLParser):
    """The text inside <main>, one paragraph or listing per block."""

    BLOCKS = {"p", "pre", "li", "h1", "h2", "h3", "h4", "tr", "blockquote", "div"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.skip = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "main":
            self.depth += 1
        if tag in ("script", "style", "button"):
            self.skip += 1
        if self.depth and tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag == "main":
            self.depth -= 1
        if tag in ("script", "style", "button"):
            self.skip -= 1
        if self.depth and tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data)

    def text(self) -> str:
        text = "".join(self.parts)
        return re.sub(r"\n{3,}", "\n\n", html.unescape(text)).strip() + "\n"


def book_dir() -> Path:
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True).stdout.strip()
    return Path(sysroot) / "share/doc/rust/html/book"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pages = sorted(glob.glob(str(book_dir() / "ch*.html")) + glob.glob(str(book_dir() / "appendix-*.html")))
    total = 0
    for page in pages:
        extractor = MainText()
        extractor.feed(Path(page).read_text(encoding="utf-8"))
        text = extractor.text()
        name = Path(page).stem + ".txt"
        (args.out / name).write_text(text, encoding="utf-8")
        total += len(text.encode("utf-8"))
    print(f"{len(pages)} chapters, {total} bytes of text in {args.out}{os.sep}")


if __name__ == "__main__":
    main()
