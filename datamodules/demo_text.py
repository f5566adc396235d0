"""A small parallel corpus made of human translations that installed packages ship.

Two sources, both curated by translators rather than machine output:

- pycountry's gettext catalogues (``pycountry.LOCALES_DIR/<lang>/LC_MESSAGES/<domain>.mo``):
  the ISO 639-3/639-5 language names, ISO 3166-1/2/3 country and subdivision
  names, ISO 4217 currency names and ISO 15924 script names. The English text is
  the catalogue key (``msgid``), every other language is a translation of it.
- babel's CLDR locale data: display names of territories, languages, scripts,
  variants, currencies (singular and plural), time zones and meta zones, units,
  date fields, days, months, quarters and eras; plural unit and date-field
  patterns are filled with a number ("{0} kilometers per hour" -> "7 kilometers per hour").

A pair is the text of the same key in the two languages. Pairs whose sides are
identical (names nobody translated) are dropped, whitespace is collapsed, and each
source sentence is kept once (the first source in the order above wins), so a
sentence never appears in two splits. The split is a stable hash of the source
sentence: the same pycountry/babel versions always give the same files.

For en-de this gives about 8k pairs (short noun phrases, 1-12 words).
"""
from __future__ import annotations

import gettext
import hashlib
import os
import re
from pathlib import Path
from typing import Iterator

from datamodules.demo import demo_root
from layers.compat import babel_locale_data, gettext_catalog

#: pycountry gettext domains, in the order their pairs are taken
PYCOUNTRY_DOMAINS = ("iso3166-1", "iso3166-3", "iso3166-2", "iso4217", "iso15924", "iso639-5", "iso639-3")

#: babel CLDR sections whose leaves are display names
CLDR_NAME_SECTIONS = (
    "territories", "languages", "scripts", "variants", "currency_names", "currency_names_plural",
    "meta_zones", "time_zones", "unit_display_names", "date_fields", "days", "months", "quarters", "eras",
)
#: CLDR sections holding "{0} ..." patterns per plural category
CLDR_PATTERN_SECTIONS = ("unit_patterns", "date_fields")
#: abbreviated forms ("km/h", "Mo") are symbols more than text
_SKIP_WIDTHS = {"short", "narrow", "abbreviated", "short-standalone", "narrow-standalone"}

SPLITS = ("train", "valid", "test")
VERSION = 1


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _pycountry_texts(lang: str) -> dict[tuple, str]:
    """(domain, English name) -> name in ``lang`` for every translated pycountry entry."""
    import pycountry

    texts: dict[tuple, str] = {}
    for domain in PYCOUNTRY_DOMAINS:
        if lang == "en":
            # the English names are the catalogue keys; any catalogue lists them all
            catalog = _catalog(pycountry.LOCALES_DIR, domain, "de") or {}
            texts.update({(domain, k): k for k in catalog})
            continue
        catalog = _catalog(pycountry.LOCALES_DIR, domain, lang)
        if catalog:
            texts.update({(domain, k): v for k, v in catalog.items()})
    return texts


def _catalog(locales_dir: str, domain: str, lang: str) -> dict[str, str] | None:
    try:
        translation = gettext.translation(domain, locales_dir, languages=[lang])
    except FileNotFoundError:
        return None
    return {k: v for k, v in gettext_catalog(translation).items() if isinstance(k, str) and k and v}


def _leaves(node, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    if hasattr(node, "items"):
        for key, value in node.items():
            if key in _SKIP_WIDTHS:
                continue
            yield from _leaves(value, path + (key,))
    elif isinstance(node, str):
        yield path, node


def _number_for(category: str, locales) -> str | None:
    """A number that falls into plural ``category`` in every locale (None if none does)."""
    candidates = {"one": (1,), "other": (7, 12, 25, 100, 3, 5)}.get(category, ())
    for n in candidates:
        if all(loc.plural_form(n) == category for loc in locales):
            return str(n)
    return None


def _cldr_texts(lang: str, other: str) -> dict[tuple, str]:
    """CLDR key path -> text in ``lang``. ``other`` is the pair's other language, so pattern
    numbers are chosen to fall into the same plural category in both."""
    import babel

    locale, locales = babel.Locale.parse(lang), (babel.Locale.parse(lang), babel.Locale.parse(other))
    texts: dict[tuple, str] = {}
    for section in CLDR_NAME_SECTIONS:
        for path, text in _leaves(babel_locale_data(locale).get(section, {})):
            if "{" not in text:
                texts[(section,) + path] = text
    for section in CLDR_PATTERN_SECTIONS:
        for path, text in _leaves(babel_locale_data(locale).get(section, {})):
            if "{0}" not in text or "{1}" in text or not path:
                continue
            number = _number_for(str(path[-1]), locales)
            if number is not None:
                texts[(section, "pattern") + path] = text.replace("{0}", number)
    return texts


def parallel_pairs(src_lang: str = "en", tgt_lang: str = "de") -> list[tuple[str, str]]:
    """All distinct (source, target) pairs for a language pair, in a fixed order.

    Raises ``ValueError`` when pycountry and babel know fewer than 100 pairs for it.
    """
    if src_lang == tgt_lang:
        raise ValueError(f"source and target language are both {src_lang!r}")
    pairs: list[tuple[str, str]] = []
    for src, tgt in (
        (_cldr_texts(src_lang, tgt_lang), _cldr_texts(tgt_lang, src_lang)),
        (_pycountry_texts(src_lang), _pycountry_texts(tgt_lang)),
    ):
        for key in sorted(src.keys() & tgt.keys(), key=repr):
            pairs.append((_normalise(src[key]), _normalise(tgt[key])))
    seen: set[str] = set()
    unique = []
    for s, t in pairs:
        if s and t and s != t and s not in seen:
            seen.add(s)
            unique.append((s, t))
    if len(unique) < 100:
        raise ValueError(f"pycountry/babel ship only {len(unique)} {src_lang}-{tgt_lang} pairs; pick another pair")
    return unique


def split_of(source: str, valid_percent: int = 5, test_percent: int = 5) -> str:
    """Stable split of a sentence from a hash of its text (independent of the corpus order)."""
    bucket = int(hashlib.sha1(source.encode("utf-8")).hexdigest(), 16) % 100
    if bucket < test_percent:
        return "test"
    if bucket < test_percent + valid_percent:
        return "valid"
    return "train"


def write_corpus(root: Path, src_lang: str = "en", tgt_lang: str = "de") -> dict[str, int]:
    """Write ``root/{train,valid,test}.{src_lang,tgt_lang}``; returns the number of pairs per split."""
    by_split: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    for s, t in parallel_pairs(src_lang, tgt_lang):
        by_split[split_of(s)].append((s, t))
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, pairs in by_split.items():
        # a fixed shuffle (by hash) so neighbouring lines are not alphabetical runs of one source
        pairs.sort(key=lambda p: hashlib.md5(p[0].encode("utf-8")).hexdigest())
        for lang, side in ((src_lang, 0), (tgt_lang, 1)):
            with open(root / f"{split}.{lang}", "w", encoding="utf-8", newline="\n") as f:
                f.writelines(p[side] + "\n" for p in pairs)
    return {split: len(pairs) for split, pairs in by_split.items()}


def demo_translation_root(src_lang: str = "en", tgt_lang: str = "de") -> Path:
    """The demo corpus for a language pair, built once into the suite's data cache."""
    return demo_root(f"translate-{src_lang}-{tgt_lang}", lambda root: write_corpus(root, src_lang, tgt_lang),
                     version=VERSION)


if __name__ == "__main__":  # pragma: no cover - manual inspection
    import sys

    pair = sys.argv[1:3] or ["en", "de"]
    root = demo_translation_root(*pair)
    print(root, {s: sum(1 for _ in open(root / f"{s}.{pair[0]}", encoding="utf-8")) for s in SPLITS})
    os.system(f"paste {root}/test.{pair[0]} {root}/test.{pair[1]} | head -20")
