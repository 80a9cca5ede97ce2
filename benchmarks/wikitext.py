"""WikiText-2 as the benchmarks and the load test read it: from ../shared/data beside the
repository (never copied into it), un-escaped, and cut to size at a line end."""

from __future__ import annotations

from pathlib import Path

WIKITEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2"

# WikiText-2 splits hyphens and separators inside numbers into " @-@ ", " @,@ ", " @.@ ".
WIKITEXT_UNESCAPE = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))


def wikitext_text(path: Path) -> str:
    """A WikiText-2 split's text with its number and hyphen escapes undone."""
    text = path.read_text(encoding="utf-8")
    for escaped, plain in WIKITEXT_UNESCAPE:
        text = text.replace(escaped, plain)
    return text


def prepare_corpus(source: Path, chars: int, workdir: Path) -> Path:
    """The first `chars` characters of a split, un-escaped and ending on a line boundary (not
    mid-word), written to `workdir` as a corpus file."""
    text = wikitext_text(source)
    cut = text[:chars]
    if len(text) > chars and "\n" in cut:
        cut = cut[: cut.rindex("\n") + 1]
    path = workdir / f"wikitext2-{source.stem}-{chars}.txt"
    path.write_text(cut, encoding="utf-8")
    return path
