"""The search index's tokeniser and BM25 settings: one definition for the index build (trainer
box) and the queries (workers), recorded in the index folder so both sides agree.

A text is NFKC-normalised and lowercased, possessive "'s" dropped, then cut into runs of word
characters (`\\w+`: letters of any script, digits, underscore). Nothing is dropped for being
short or numeric, so "IL-6 receptor" gives il, 6, receptor; "vitamin D" gives vitamin, d;
"type 2 diabetes" gives type, 2, diabet; "α-synuclein" gives α, synuclein. Stop words are
Lucene's English list (what pyserini's default analyser removes), then each token is stemmed
with PyStemmer: "porter" (Porter's 1980 stemmer, as pyserini/Lucene's English analyser), "english"
(Snowball's English, Porter2) or "none". A word its stemmer would leave empty (Porter stems
"s", as in "s.post", to nothing) stays as it is: an index term is never empty (the compact
index's term table refuses an empty term, so one such word would make the whole index unusable).

Presets (`PRESETS`): "default" (Snowball English stemming, k1 1.5, b 0.75) and "search-r1"
(Porter stemming, k1 0.9, b 0.4: Search-R1's pyserini BM25). `Bm25Settings.as_meta` is what the
index folder (`SETTINGS_FILE`) and the task meta record; `from_meta` checks it strictly.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Stemming = Literal["porter", "english", "none"]
Stopwords = Literal["lucene", "none"]
PresetName = Literal["default", "search-r1"]

SETTINGS_FILE = "stoa.index.json"
SETTINGS_FORMAT = "stoa.bm25/2"

#: Lucene's English stop words (`EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`), pyserini's default.
LUCENE_STOPWORDS = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was", "will", "with"]
)
_WORD = re.compile(r"\w+")
_POSSESSIVE = re.compile(r"['\u2019]s\b")


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerSpec:
    """How texts become index terms (see the module doc)."""

    stemmer: Stemming = "english"
    stopwords: Stopwords = "lucene"

    def __post_init__(self) -> None:
        if self.stemmer not in get_args(Stemming):
            raise ValueError(f"stemmer must be one of {list(get_args(Stemming))}, got {self.stemmer!r}")
        if self.stopwords not in get_args(Stopwords):
            raise ValueError(f"stopwords must be one of {list(get_args(Stopwords))}, got {self.stopwords!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Bm25Settings:
    """BM25's parameters (Lucene scoring) and the tokeniser of one index."""

    k1: float = 1.5
    b: float = 0.75
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)

    def __post_init__(self) -> None:
        for name, value, high in (("k1", self.k1, 100.0), ("b", self.b, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise ValueError(f"BM25 {name} must be a number in [0, {high:g}], got {value!r}")

    def as_meta(self) -> dict[str, Any]:
        return {
            "format": SETTINGS_FORMAT,
            "k1": float(self.k1),
            "b": float(self.b),
            "tokenizer": {"pattern": "words", "stemmer": self.tokenizer.stemmer, "stopwords": self.tokenizer.stopwords},
        }

    @classmethod
    def from_meta(cls, meta: Any) -> Bm25Settings:
        """Settings recorded by `as_meta`; ValueError naming what is wrong (an index built by an
        earlier tokeniser has another format and is refused here)."""
        if not isinstance(meta, Mapping) or set(meta) != {"format", "k1", "b", "tokenizer"}:
            raise ValueError("BM25 settings: expected an object with format, k1, b and tokenizer")
        if meta["format"] != SETTINGS_FORMAT:
            raise ValueError(f"BM25 settings format is {meta['format']!r}, this stoa reads {SETTINGS_FORMAT!r}: rebuild the index")
        tok = meta["tokenizer"]
        if not isinstance(tok, Mapping) or set(tok) != {"pattern", "stemmer", "stopwords"} or tok["pattern"] != "words":
            raise ValueError(f"BM25 settings: unsupported tokenizer {tok!r}")
        return cls(k1=meta["k1"], b=meta["b"], tokenizer=TokenizerSpec(stemmer=tok["stemmer"], stopwords=tok["stopwords"]))


PRESETS: Mapping[PresetName, Bm25Settings] = {
    "default": Bm25Settings(),
    "search-r1": Bm25Settings(k1=0.9, b=0.4, tokenizer=TokenizerSpec(stemmer="porter")),
}


STEM_CACHE_WORDS = 2_000_000  # distinct words whose stems a tokeniser remembers (then it starts over)


def _stemmer(stemmer: Stemming) -> Callable[[list[str]], list[str]] | None:
    if stemmer == "none":
        return None
    try:
        import Stemmer
    except ImportError:
        raise ValueError("the search index stems words with PyStemmer: pip install PyStemmer") from None
    return Stemmer.Stemmer(stemmer).stemWords


class Tokenizer:
    """`tokenizer(text)` -> the text's index terms, in order (see the module doc)."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._stop = LUCENE_STOPWORDS if spec.stopwords == "lucene" else frozenset()
        self._stem_words = _stemmer(spec.stemmer)
        self._stems: dict[str, str] = {}  # word -> stem: a dict lookup is cheaper than the stemmer

    def __call__(self, text: str) -> list[str]:
        text = _POSSESSIVE.sub("", unicodedata.normalize("NFKC", text).lower())
        stop = self._stop
        words = [w for w in _WORD.findall(text) if w not in stop]
        if self._stem_words is None:
            return words
        # one read of the shared cache per word, so threads searching at once never miss an entry
        stems = self._stems
        found = [stems.get(w) for w in words]
        missing = [w for w, s in zip(words, found, strict=True) if s is None]
        if not missing:
            return found  # type: ignore[return-value]
        fresh = {w: stem or w for w, stem in zip(missing, self._stem_words(missing), strict=True)}
        if len(stems) > STEM_CACHE_WORDS:
            stems.clear()
        stems.update(fresh)
        return [s if s is not None else fresh[w] for w, s in zip(words, found, strict=True)]
