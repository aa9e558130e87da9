"""Customer-data detection: which kinds of personal data a request's text contains.

Candidates are found by regular expressions and confirmed by the number's own checksum
(python-stdnum: IBAN mod 97, Luhn for cards, the key or check digit of each national id;
Google's libphonenumber for phone numbers), so an order number is not a card and a card is
not missed for its spaces. Presidio was evaluated and left out: its recognisers need a
spaCy language model, which the router would have to download, and its own users found it
failing open on analyzer errors. Findings carry the entity kind only, never the value, so
they can be logged and counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import phonenumbers
from stdnum import iban, luhn
from stdnum.de import idnr
from stdnum.es import dni
from stdnum.fr import nir
from stdnum.it import codicefiscale
from stdnum.us import ssn

from pagellm.router.config import PrivacyConfig

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}\b")
# Phone candidates (7 to 15 digits, with the usual separators), each then parsed and checked
# against the numbering plan by libphonenumber: much cheaper than its own matcher's scan.
_PHONE = re.compile(r"(?<![\w+])\+?\(?\d[\d \t().\-/]{5,22}\d(?!\d)")
# Digit-led patterns start with `\d(?<!\d\d)` (a digit that does not follow one) rather than
# a look-behind: the regex engine then skips quickly to the next digit.
_CARD = re.compile(r"\d(?<!\d\d)(?:[ -]?\d){12,18}(?!\d)")
_DATE_OR_TIME = re.compile(r"\d{1,4}([./-])\d{1,2}\1\d{1,4}|\d{1,2}:\d{2}(?::\d{2})?")
# Each national id: a candidate pattern and the checksum validator that confirms it.
_NATIONAL_IDS: tuple[tuple[re.Pattern[str], Callable[[str], bool]], ...] = (
    (re.compile(r"\d(?<!\d\d)\d{2}-\d{2}-\d{4}(?!\d)"), ssn.is_valid),                # US SSN
    (re.compile(r"[12](?<![\dA-Z][12]) ?\d{2} ?\d{2} ?(?:\d{2}|2[AB]) ?\d{3} ?\d{3} ?\d{2}"
                r"(?!\d)"), nir.is_valid),                                          # FR NIR
    (re.compile(r"\d(?<!\d\d)\d ?\d{3} ?\d{3} ?\d{3}(?!\d)"), idnr.is_valid),         # DE IdNr
    (re.compile(r"\d(?<![\dA-Z]\d)\d{7}-?[A-Z](?![A-Z\d])"), dni.is_valid),           # ES DNI
    (re.compile(r"\b[A-Z]{6}\d{2}[A-Z]\d{2}[A-Z]\d{3}[A-Z]\b"), codicefiscale.is_valid),  # IT CF
)


@dataclass(frozen=True)
class Finding:
    entity: str   # "email", "phone", ..., "customer_name", "pattern:<name>", "unscannable"


def request_texts(body: Any) -> Iterator[str]:
    """Every string in the request body but the model name: messages, system prompt, tool
    definitions, names, metadata. Nothing is skipped, so no field is a way around the scan."""
    if isinstance(body, str):
        yield body
    elif isinstance(body, dict):
        for key, value in body.items():
            if key != "model":
                yield from request_texts(value)
    elif isinstance(body, list):
        for item in body:
            yield from request_texts(item)


def _card(text: str) -> bool:
    for match in _CARD.finditer(text):
        digits = re.sub(r"[ -]", "", match.group())
        if 13 <= len(digits) <= 19 and digits[0] in "3456" and luhn.is_valid(digits):
            return True
    return False


def _iban(text: str) -> bool:
    return any(iban.is_valid(match.group()) for match in _IBAN.finditer(text))


def _national_id(text: str) -> bool:
    return any(valid(match.group()) for pattern, valid in _NATIONAL_IDS
               for match in pattern.finditer(text))


class PIIDetector:
    def __init__(self, config: PrivacyConfig) -> None:
        self.regions = config.phone_regions
        checks: dict[str, Callable[[str], bool]] = {
            "email": lambda text: _EMAIL.search(text) is not None,
            "phone": self._phone, "iban": _iban, "credit_card": _card,
            "national_id": _national_id}
        self.checks = [(entity, checks[entity]) for entity in config.pii]
        if config.customer_names:
            names = sorted(config.customer_names, key=len, reverse=True)
            pattern = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b",
                                 re.IGNORECASE)
            self.checks.append(("customer_name", lambda text: pattern.search(text) is not None))
        for name, expression in config.patterns.items():
            compiled = re.compile(expression)
            self.checks.append((f"pattern:{name}",
                                lambda text, p=compiled: p.search(text) is not None))

    def _phone(self, text: str) -> bool:
        for match in _PHONE.finditer(text):
            candidate = match.group()
            if (not 7 <= sum(ch.isdigit() for ch in candidate) <= 15
                    or _DATE_OR_TIME.fullmatch(candidate.strip())):
                continue
            regions = [None] if candidate.startswith("+") else self.regions
            for region in regions:
                try:
                    number = phonenumbers.parse(candidate, region)
                except phonenumbers.NumberParseException:
                    continue
                if phonenumbers.is_valid_number(number):
                    return True
        return False

    def scan(self, body: dict[str, Any]) -> list[Finding]:
        """The kinds of customer data in the body. Raises if a detector fails: the caller
        treats that as customer data (fail closed)."""
        found: dict[str, None] = {}
        for text in request_texts(body):
            if text.startswith("data:"):   # an inline image or file: nothing to read
                found["unscannable"] = None
                continue
            for entity, check in self.checks:
                if entity not in found and check(text):
                    found[entity] = None
        if _token_prompt(body):
            found["unscannable"] = None
        return [Finding(entity) for entity in found]


def _token_prompt(body: dict[str, Any]) -> bool:
    """A prompt given as token ids (or embeddings input as ids) cannot be read for PII."""
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, list) and any(isinstance(item, (int, list)) for item in value):
            return True
    return False
