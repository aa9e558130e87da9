"""Documents to chunks: split by headings, then by size in the embedding model's tokens.

Each section keeps its path of headings, the breadcrumb (`Doc title > Section >
Subsection`). The text that is embedded is the chunk prefixed by that breadcrumb and
the document's metadata, so a chunk that says "set it to 0 to disable" still carries
what "it" is; the raw chunk is what the payload stores and the prompt shows. Every
embedded text, prefix included, fits the model's input limit: a section too long is
cut between paragraphs, a paragraph too long between lines, then between words.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

SUFFIXES = {".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html",
            ".txt": "text", ".text": "text", ".rst": "text"}
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HTML_HEADINGS = {f"h{level}": level for level in range(1, 7)}
_HTML_BLOCKS = {"p", "div", "li", "br", "pre", "tr", "table", "ul", "ol", "section",
                "article", "blockquote", "dd", "dt"}
_HTML_SKIPPED = {"script", "style", "nav", "head"}

TokenCounter = Callable[[str], int]


@dataclass
class Section:
    headings: list[str]  # the document title first
    text: str


@dataclass
class Chunk:
    source: str
    index: int  # its position in the document
    breadcrumb: str
    text: str  # the raw chunk, stored as page_content
    embedded_text: str  # breadcrumb + metadata + text: what the vector is computed from
    metadata: dict = field(default_factory=dict)


def markdown_sections(text: str, fallback_title: str) -> list[Section]:
    """Sections under each heading; `#` lines inside fenced code are not headings."""
    title, path, body, sections, fenced = None, [], [], [], False

    def flush() -> None:
        if "\n".join(body).strip():
            sections.append(Section([title or fallback_title, *path], "\n".join(body).strip()))
        body.clear()

    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match is None:
            body.append(line)
            continue
        flush()
        level, heading = len(match.group(1)), match.group(2).strip()
        if level == 1 and title is None:
            title = heading
            continue
        depth = max(level - 2, 0)  # `##` is the first level below the title
        path = [*path[:depth], heading]
    flush()
    return sections


class _HTMLSections(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.title: str | None = None
        self.path: list[str] = []
        self.sections: list[tuple[list[str], str]] = []
        self.buffer: list[str] = []
        self.heading: tuple[int, list[str]] | None = None
        self.skipping = 0
        self.in_title = False
        self.seen_h1 = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _HTML_SKIPPED:
            self.skipping += 1
        elif tag == "title":
            self.in_title = True
        elif tag in _HTML_HEADINGS:
            self._flush()
            self.heading = (_HTML_HEADINGS[tag], [])
        elif tag in _HTML_BLOCKS:
            self.buffer.append("\n\n" if tag in ("p", "pre", "table") else "\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _HTML_SKIPPED:
            self.skipping = max(self.skipping - 1, 0)
        elif tag == "title":
            self.in_title = False
        elif tag in _HTML_HEADINGS and self.heading is not None:
            level, words = self.heading
            text = " ".join("".join(words).split())
            self.heading = None
            if level == 1 and not self.seen_h1:  # the page's own title beats <title>
                self.title, self.seen_h1 = text, True
            elif text:
                self.path = [*self.path[:max(level - 2, 0)], text]

    def handle_data(self, data: str) -> None:
        if self.in_title and self.title is None:
            self.title = " ".join(data.split()) or None
        elif self.heading is not None:
            self.heading[1].append(data)
        elif not self.skipping:
            self.buffer.append(data)

    def _flush(self) -> None:
        text = re.sub(r"\n\s*\n\s*", "\n\n", "".join(self.buffer)).strip()
        if text:
            self.sections.append((list(self.path), text))
        self.buffer = []


def html_sections(text: str, fallback_title: str) -> list[Section]:
    parser = _HTMLSections()
    parser.feed(text)
    parser.close()
    parser._flush()
    title = parser.title or fallback_title
    return [Section([title, *path], body) for path, body in parser.sections]


def text_sections(text: str, fallback_title: str) -> list[Section]:
    return [Section([fallback_title], text.strip())] if text.strip() else []


def read_sections(path: Path) -> list[Section]:
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: not Markdown, HTML or text ({', '.join(sorted(SUFFIXES))}).")
    text = path.read_text(encoding="utf-8", errors="replace")
    title = path.stem.replace("-", " ").replace("_", " ")
    reader = {"markdown": markdown_sections, "html": html_sections, "text": text_sections}[kind]
    return reader(text, title)


def prefix_of(breadcrumb: str, metadata: dict) -> str:
    """The context line(s) embedded before a chunk."""
    details = " | ".join(str(metadata[key]) for key in ("source", "date") if metadata.get(key))
    return f"{breadcrumb}\nSource: {details}\n\n" if details else f"{breadcrumb}\n\n"


def _pieces(text: str) -> list[str]:
    """Paragraphs, fenced code blocks kept whole."""
    pieces, current, fenced = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if not line.strip() and not fenced:
            if current:
                pieces.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if current:
        pieces.append("\n".join(current))
    return pieces


def _fit(pieces: list[str], joiner: str, fits: Callable[[str], bool]) -> list[str]:
    """Greedy runs of pieces whose joined text fits; a piece that cannot fit alone is
    returned alone (the caller splits it finer)."""
    out, current = [], ""
    for piece in pieces:
        candidate = f"{current}{joiner}{piece}" if current else piece
        if fits(candidate):
            current = candidate
            continue
        if current:
            out.append(current)
        current = piece
    if current:
        out.append(current)
    return out


def split_text(text: str, fits: Callable[[str], bool]) -> list[str]:
    """`text` in parts that each fit, cut at paragraphs, then lines, then words."""
    parts = []
    for paragraph in _fit(_pieces(text), "\n\n", fits):
        if fits(paragraph):
            parts.append(paragraph)
            continue
        for line in _fit(paragraph.splitlines(), "\n", fits):
            parts.extend([line] if fits(line) else _split_words(line, fits))
    return parts


def _split_words(line: str, fits: Callable[[str], bool]) -> list[str]:
    words = _fit(line.split(" "), " ", fits)
    too_long = [w for w in words if not fits(w)]
    if too_long:
        raise ValueError(f"a single word of {len(too_long[0])} characters does not fit the "
                         "embedding model's input limit with its breadcrumb.")
    return words


def chunk_document(source: str, sections: list[Section], metadata: dict,
                   count_tokens: TokenCounter, max_tokens: int,
                   breadcrumbs: bool = True) -> list[Chunk]:
    """Chunks of every section; `count_tokens` counts a text as the model will see it
    (special tokens included), and no embedded text exceeds `max_tokens`."""
    chunks: list[Chunk] = []
    for section in sections:
        breadcrumb = " > ".join(section.headings)
        prefix = prefix_of(breadcrumb, {"source": source, **metadata}) if breadcrumbs else ""

        def fits(text: str, prefix: str = prefix) -> bool:
            return count_tokens(prefix + text) <= max_tokens

        if not fits(""):
            raise ValueError(f"{source}: the breadcrumb {breadcrumb!r} alone exceeds the "
                             f"embedding model's {max_tokens} tokens.")
        for part in split_text(section.text, fits):
            chunks.append(Chunk(source, len(chunks), breadcrumb, part, prefix + part,
                                {**metadata, "source": source, "breadcrumb": breadcrumb,
                                 "headings": section.headings, "chunk_index": len(chunks)}))
    return chunks
