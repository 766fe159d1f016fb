"""Prompt preprocessing for LlamaGen's FLAN-T5 text encoder.

LlamaGen's text-to-image samplers (FoundationVision/LlamaGen, ``language/t5.py``,
``T5Embedder.text_preprocessing`` / ``T5Embedder.clean_caption``, itself taken from
PixArt-alpha's ``diffusion/model/t5.py`` and DeepFloyd IF) normalise every prompt before
tokenisation. The T5 embeddings, and so the generated images, depend on the exact string
that comes out, so this module reproduces that function's output character for character.

The regular expressions below are upstream's, unchanged (they *are* the behaviour,
quirks included: e.g. the ``\\\\n`` rule removes a literal backslash-n, not a newline, and
the whitespace is not stripped before the final edge rules). Only the organisation is
ours: the cleaner is a fixed sequence of stages, most of them tables of
``(pattern, replacement)`` pairs applied in order with ``re.sub``.

Third-party dependencies (``ftfy`` and ``beautifulsoup4``) are imported lazily, on the
first call, so importing this module stays cheap.
"""

from __future__ import annotations

import html
import re
import urllib.parse
import warnings

__all__ = ["clean_caption", "preprocess_caption"]

_Rule = tuple[re.Pattern[str], str]


def _rules(*pairs: tuple[str, str]) -> tuple[_Rule, ...]:
    return tuple((re.compile(pattern), repl) for pattern, repl in pairs)


def _apply(rules: tuple[_Rule, ...], text: str) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text


# Upstream's list of "bad" punctuation, turned into a space: # ® • © ™ & @ · º ½ ¾ ¿ ¡ § ~
# ) ( ] [ } { | \ / *
_BAD_PUNCT = r"[#®•©™&@·º½¾¿¡§~\)\(\]\[\}\{\|\\/\*]{1,}"

# Stage 1, before HTML text extraction: the <person> placeholder and URLs.
_MARKUP_RULES = _rules(
    ("<person>", "person"),
    # Scheme URLs (http:, https:) and bare domains with a known TLD, with their path.
    (r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)"
     r"[\w/-]*\b\/?(?!@)))", ""),
    # Same again with a "www:" pseudo-scheme (upstream's second URL pass).
    (r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)"
     r"[\w/-]*\b\/?(?!@)))", ""),
)

# Stage 2, after HTML text extraction and before ftfy.
_TEXT_RULES = _rules(
    # @nicknames.
    (r"@[\w\d]+\b", ""),
    # CJK blocks, dropped: strokes, katakana phonetic extensions, enclosed CJK letters,
    # CJK compatibility, unified ideographs ext. A, Yijing hexagrams, unified ideographs.
    (r"[\u31c0-\u31ef]+", ""),
    (r"[\u31f0-\u31ff]+", ""),
    (r"[\u3200-\u32ff]+", ""),
    (r"[\u3300-\u33ff]+", ""),
    (r"[\u3400-\u4dbf]+", ""),
    (r"[\u4dc0-\u4dff]+", ""),
    (r"[\u4e00-\u9fff]+", ""),
    # Every kind of dash (a run of them) becomes one ASCII hyphen.
    (r"[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C"
     r"\u3030\u30A0\uFE31\uFE32\uFE58\uFE63\uFF0D]+", "-"),
    # Typographic double quotes to '"', single quotes to "'".
    (r"[`´«»“”¨]", '"'),
    (r"[‘’]", "'"),
    # Leftover (double-escaped) &quot; and &amp entities.
    (r"&quot;?", ""),
    (r"&amp", ""),
    # IPv4 addresses.
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),
    # Trailing "article id" time stamps such as "1:23 " (needs trailing whitespace).
    (r"\d:\d\d\s+$", ""),
    # A literal backslash followed by "n" (an escaped newline in the source data).
    (r"\\n", " "),
    # Hash ids "#1".."#999", "#12345..", and bare numbers of six or more digits.
    (r"#\d{1,3}\b", ""),
    (r"#\d{5,}\b", ""),
    (r"\b\d{6,}\b", ""),
    # File names with an image / document / app / video extension.
    (r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", ""),
    # Runs of quotes collapse to one '"'; runs of dots become a space.
    (r"[\"\']{2,}", r'"'),
    (r"[\.]{2,}", r" "),
    # Bad punctuation to a space; a lone " . " to a space.
    (_BAD_PUNCT, r" "),
    (r"\s+\.\s+", r" "),
)

# Word separators in slug-like captions (this-is-my-cat, this_is_my_cat).
_SEPARATOR = re.compile(r"(?:\-|\_)")
_MAX_KEPT_SEPARATORS = 3  # more than this many '-'/'_' in total: all become spaces

# Stage 3, after ftfy and HTML unescaping.
_POST_RULES = _rules(
    # Product-code-like tokens: jc6640, jc6640vc, 6640vc231.
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),
    (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),
    (r"\b\d+[a-zA-Z]+\d+\b", ""),
    # Shop / download spam and file-type words.
    (r"(worldwide\s+)?(free\s+)?shipping", ""),
    (r"(free\s)?download(\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""),
    (r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", ""),
    (r"\bpage\s+\d+\b", ""),
    # Longer alternating letter/digit codes (j2d1a2a...) become a space.
    (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", r" "),
    # Dimensions such as 1920x1080, 2.5×3 (Latin x, Cyrillic х, multiplication sign).
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),
    # Spacing: " : " -> ": ", a space after , . / that precede a word, collapse whitespace.
    (r"\b\s+\:\s+", r": "),
    (r"(\D[,\./])\b", r"\1 "),
    (r"\s+", " "),
)

# Stage 4, edges. Upstream calls ``caption.strip()`` here without keeping the result, so
# these rules see any single leading/trailing space left by stage 3; we do the same.
_EDGE_RULES = _rules(
    # One pair of surrounding quotes.
    (r"^[\"\']([\w\W]+)[\"\']$", r"\1"),
    # One leading ' _ , - : ; and one trailing ' _ , - : +.
    (r"^[\'\_,\-\:;]", r""),
    (r"[\'\_,\-\:\-\+]$", r""),
    # A caption that is a single ".token" is dropped.
    (r"^\.\S+$", ""),
)


def _html_text(text: str) -> str:
    """Text content of ``text`` parsed as HTML, as upstream gets it (bs4 + html.parser)."""
    import bs4

    with warnings.catch_warnings():
        # bs4 warns when the markup looks like a URL or file name (or XML); irrelevant here.
        for name in ("MarkupResemblesLocatorWarning", "XMLParsedAsHTMLWarning"):
            category = getattr(bs4, name, None) or getattr(bs4.builder, name, None)
            if category is not None:
                warnings.simplefilter("ignore", category)
        return bs4.BeautifulSoup(text, features="html.parser").text


def _fix_text(text: str) -> str:
    """Upstream ``basic_clean``: ftfy repair, HTML-unescape twice, strip."""
    import ftfy

    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    return text.strip()


def clean_caption(text: str) -> str:
    """One pass of upstream's ``T5Embedder.clean_caption``."""
    text = urllib.parse.unquote_plus(str(text))  # '+' -> ' ', %XX decoded
    text = text.strip().lower()
    text = _apply(_MARKUP_RULES, text)
    text = _html_text(text)
    text = _apply(_TEXT_RULES, text)
    if len(_SEPARATOR.findall(text)) > _MAX_KEPT_SEPARATORS:
        text = _SEPARATOR.sub(" ", text)
    text = _fix_text(text)
    text = _apply(_POST_RULES, text)
    text = _apply(_EDGE_RULES, text)
    return text.strip()


def preprocess_caption(text: str, clean: bool = True) -> str:
    """Upstream ``T5Embedder.text_preprocessing``.

    With ``clean`` (upstream ``use_text_preprocessing=True``, the samplers' default) the
    caption goes through :func:`clean_caption` twice, as upstream does; otherwise it is
    only lower-cased and stripped.
    """
    if clean:
        return clean_caption(clean_caption(text))
    return text.lower().strip()
