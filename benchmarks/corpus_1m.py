"""A real-text corpus of about 1M SmolLM2 tokens, for the 1M-entry store of the load test and `knnlm-eval`.

WikiText-2 here has only valid and test (~275k + ~280k tokens), and test is what the store is
judged on, so the corpus is WikiText-2 valid (un-escaped, as the other benchmarks read it; one
document, the longest, so that the build's calibration holds out WikiText) plus the King James
Bible from Debian's `bible-kjv` packages (public domain; `apt-get download`, no root needed), one
file per book, books in order until the corpus reaches `--tokens`.

    .venv/bin/python benchmarks/corpus_1m.py --out /tmp/corpus1m
    .venv/bin/knnlm-index build /tmp/corpus1m -o /tmp/real1m --stride 480   # ~35 min on 2 cores
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from wikitext import WIKITEXT, prepare_corpus

CHAPTER = re.compile(r"^(\S.*?) (\d+)$")  # "Genesis 1"
VERSE = re.compile(r"^\s+\d+ (.*)$")  # "  1 In the beginning ..."


def bible_books(workdir: Path) -> list[tuple[str, str]]:
    """(book, text) in canonical order; each chapter one paragraph, verse numbers dropped."""
    try:
        subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=workdir, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        raise SystemExit(
            f"corpus_1m: could not download Debian's bible-kjv packages ({detail}); run it on a Debian or Ubuntu host with apt sources"
        ) from e
    for deb in workdir.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    bible, data = workdir / "root/usr/bin/bible", workdir / "root/usr/lib"
    text = subprocess.run([str(bible), "-p", str(data), "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    books: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if chapter := CHAPTER.match(line):
            if not books or books[-1][0] != chapter.group(1):
                books.append((chapter.group(1), []))
            books[-1][1].append("")
        elif books and line.strip():
            verse = VERSE.match(line)
            books[-1][1][-1] += (" " if books[-1][1][-1] else "") + (verse.group(1) if verse else line).strip()
    return [(name, "\n\n".join(chapters) + "\n") for name, chapters in books]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory to write (wikitext2-valid.txt, kjv/NN-Book.txt)")
    parser.add_argument("--tokens", type=int, default=1_040_000, help="stop adding books at this many tokens in all")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from knnlm_core.default_model import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    with tempfile.TemporaryDirectory() as tmp:
        bible = bible_books(Path(tmp))  # before writing anything: a failed download leaves no partial corpus
    args.out.mkdir(parents=True, exist_ok=True)
    wiki = prepare_corpus(WIKITEXT / "valid.txt", (WIKITEXT / "valid.txt").stat().st_size, args.out)  # all of it
    total = len(tokenizer(wiki.read_text()).input_ids)
    (args.out / "kjv").mkdir(exist_ok=True)
    books = 0
    for name, text in bible:
        if total >= args.tokens:
            break
        books += 1
        (args.out / "kjv" / f"{books:02d}-{name.replace(' ', '_')}.txt").write_text(text)
        total += len(tokenizer(text).input_ids)
    print(f"{args.out}: {total} tokens (WikiText-2 valid and {books} books of the King James Bible)")


if __name__ == "__main__":
    main()
