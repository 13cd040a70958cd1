"""Spoken-form text: what a reader says for "$12.50", "3:45 pm", "Dr. Smith" or "555-0123".

The model reads letters; digits, symbols, markdown and emoji come out garbled or silent. Every
clause goes through `normalize_text` before it is tokenized (see `text.plan_clause`).

Numbers become words with `num2words` (all seven languages the engine serves, ~0.2 ms a call);
everything around them (which digits form a time, a date, a price or a phone number, the words
for units, currencies, months and abbreviations) is a small table per language below. Rules run
from the most specific pattern to the least, so that "2026-11-30" is read as a date before its
parts could be read as a phone number, a range or three numbers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from num2words import num2words

__all__ = ["LANGUAGES", "WORDS_BEFORE_NUMBERS", "normalize_text"]

LANGUAGES = ("en", "fr", "de", "es", "it", "pt", "nl")


@dataclass(frozen=True)
class _Lang:
    code: str
    decimal_sep: str  # the decimal mark in written numbers
    thousands_sep: str  # "," in English; "." elsewhere (French also writes a space)
    point: str  # the word read for the decimal mark
    and_: str  # between units and cents
    to: str  # in ranges, "5-10"
    percent: str
    plus: str
    dot: str
    at: str
    slash: str
    dash: str
    underscore: str
    months: tuple[str, ...]
    # symbol -> (singular, plural, cent singular, cent plural)
    currencies: dict[str, tuple[str, str, str, str]]
    units: dict[str, tuple[str, str]]
    abbreviations: dict[str, str]
    # A feminine/short "one" before a noun where the cardinal differs ("uno" -> "un dólar").
    one_before_noun: str | None = None
    am: str = "a m"
    pm: str = "p m"
    extra: dict[str, str] = field(default_factory=dict)  # symbols: "&" -> "and"


_CURRENCY_CODES = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥"}

_LANGS: dict[str, _Lang] = {
    "en": _Lang(
        "en", ".", ",", "point", "and", "to", "percent", "plus", "dot", "at", "slash", "dash",
        "underscore",
        ("January", "February", "March", "April", "May", "June", "July", "August", "September",
         "October", "November", "December"),
        {
            "$": ("dollar", "dollars", "cent", "cents"),
            "€": ("euro", "euros", "cent", "cents"),
            "£": ("pound", "pounds", "penny", "pence"),
            "¥": ("yen", "yen", "sen", "sen"),
        },
        {
            "km/h": ("kilometer per hour", "kilometers per hour"), "mph": ("mile per hour",
            "miles per hour"), "km": ("kilometer", "kilometers"), "cm": ("centimeter",
            "centimeters"), "mm": ("millimeter", "millimeters"), "m": ("meter", "meters"),
            "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"), "g": ("gram",
            "grams"), "ml": ("milliliter", "milliliters"), "l": ("liter", "liters"),
            "lbs": ("pound", "pounds"), "lb": ("pound", "pounds"), "oz": ("ounce", "ounces"),
            "ft": ("foot", "feet"), "mi": ("mile", "miles"), "°C": ("degree Celsius",
            "degrees Celsius"), "°F": ("degree Fahrenheit", "degrees Fahrenheit"), "°": ("degree",
            "degrees"), "ms": ("millisecond", "milliseconds"), "min": ("minute", "minutes"),
            "h": ("hour", "hours"), "s": ("second", "seconds"), "kWh": ("kilowatt hour",
            "kilowatt hours"), "kW": ("kilowatt", "kilowatts"), "W": ("watt", "watts"),
            "V": ("volt", "volts"), "TB": ("terabyte", "terabytes"), "GB": ("gigabyte",
            "gigabytes"), "MB": ("megabyte", "megabytes"), "kB": ("kilobyte", "kilobytes"),
            "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"),
            "kHz": ("kilohertz", "kilohertz"), "Hz": ("hertz", "hertz"),
        },
        {
            "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miss", "Dr.": "Doctor",
            "Prof.": "Professor", "Jr.": "Junior", "Sr.": "Senior", "vs.": "versus",
            "etc.": "et cetera", "e.g.": "for example", "i.e.": "that is",
            "approx.": "approximately", "Ave.": "Avenue", "Rd.": "Road", "Blvd.": "Boulevard",
            "Mt.": "Mount", "Inc.": "Incorporated", "Ltd.": "Limited", "Co.": "Company",
            "Dept.": "Department", "Jan.": "January", "Feb.": "February", "Aug.": "August",
            "Sept.": "September", "Oct.": "October", "Nov.": "November", "Dec.": "December",
        },
        extra={"&": "and"},
    ),
    "fr": _Lang(
        "fr", ",", ".", "virgule", "et", "à", "pour cent", "plus", "point", "arobase", "slash",
        "tiret", "tiret bas",
        ("janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août", "septembre",
         "octobre", "novembre", "décembre"),
        {
            "$": ("dollar", "dollars", "cent", "cents"),
            "€": ("euro", "euros", "centime", "centimes"),
            "£": ("livre", "livres", "penny", "pence"),
            "¥": ("yen", "yens", "sen", "sen"),
        },
        {
            "km/h": ("kilomètre heure", "kilomètres heure"), "km": ("kilomètre", "kilomètres"),
            "cm": ("centimètre", "centimètres"), "mm": ("millimètre", "millimètres"),
            "m": ("mètre", "mètres"), "kg": ("kilo", "kilos"), "mg": ("milligramme",
            "milligrammes"), "g": ("gramme", "grammes"), "ml": ("millilitre", "millilitres"),
            "l": ("litre", "litres"), "°C": ("degré Celsius", "degrés Celsius"),
            "°": ("degré", "degrés"), "ms": ("milliseconde", "millisecondes"),
            "min": ("minute", "minutes"), "s": ("seconde", "secondes"), "kWh": ("kilowattheure",
            "kilowattheures"), "kW": ("kilowatt", "kilowatts"), "W": ("watt", "watts"),
            "V": ("volt", "volts"), "To": ("téraoctet", "téraoctets"), "Go": ("gigaoctet",
            "gigaoctets"), "Mo": ("mégaoctet", "mégaoctets"), "Ko": ("kilooctet", "kilooctets"),
            "GHz": ("gigahertz", "gigahertz"), "MHz": ("mégahertz", "mégahertz"),
            "Hz": ("hertz", "hertz"),
        },
        {
            "M.": "Monsieur", "MM.": "Messieurs", "Mme": "Madame", "Mmes": "Mesdames",
            "Mlle": "Mademoiselle", "Dr": "Docteur", "Pr": "Professeur", "etc.": "et cetera",
            "p. ex.": "par exemple", "c.-à-d.": "c'est-à-dire", "n°": "numéro",
            "env.": "environ", "av.": "avenue", "bd": "boulevard", "St": "Saint",
            "Ste": "Sainte", "cf.": "voir",
        },
        one_before_noun="un",
        extra={"&": "et"},
    ),
    "de": _Lang(
        "de", ",", ".", "Komma", "und", "bis", "Prozent", "plus", "Punkt", "at", "Schrägstrich",
        "Bindestrich", "Unterstrich",
        ("Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September",
         "Oktober", "November", "Dezember"),
        {
            "$": ("Dollar", "Dollar", "Cent", "Cent"),
            "€": ("Euro", "Euro", "Cent", "Cent"),
            "£": ("Pfund", "Pfund", "Penny", "Pence"),
            "¥": ("Yen", "Yen", "Sen", "Sen"),
        },
        {
            "km/h": ("Kilometer pro Stunde", "Kilometer pro Stunde"), "km": ("Kilometer",
            "Kilometer"), "cm": ("Zentimeter", "Zentimeter"), "mm": ("Millimeter",
            "Millimeter"), "m": ("Meter", "Meter"), "kg": ("Kilogramm", "Kilogramm"),
            "mg": ("Milligramm", "Milligramm"), "g": ("Gramm", "Gramm"), "ml": ("Milliliter",
            "Milliliter"), "l": ("Liter", "Liter"), "°C": ("Grad Celsius", "Grad Celsius"),
            "°": ("Grad", "Grad"), "ms": ("Millisekunde", "Millisekunden"), "min": ("Minute",
            "Minuten"), "Std.": ("Stunde", "Stunden"), "s": ("Sekunde", "Sekunden"),
            "kWh": ("Kilowattstunde", "Kilowattstunden"), "kW": ("Kilowatt", "Kilowatt"),
            "W": ("Watt", "Watt"), "V": ("Volt", "Volt"), "TB": ("Terabyte", "Terabyte"),
            "GB": ("Gigabyte", "Gigabyte"), "MB": ("Megabyte", "Megabyte"), "kB": ("Kilobyte",
            "Kilobyte"), "GHz": ("Gigahertz", "Gigahertz"), "MHz": ("Megahertz", "Megahertz"),
            "Hz": ("Hertz", "Hertz"),
        },
        {
            "Hr.": "Herr", "Fr.": "Frau", "Dr.": "Doktor", "Prof.": "Professor",
            "z.B.": "zum Beispiel", "z. B.": "zum Beispiel", "usw.": "und so weiter",
            "bzw.": "beziehungsweise", "d.h.": "das heißt", "d. h.": "das heißt",
            "ca.": "circa", "Nr.": "Nummer", "Str.": "Straße", "evtl.": "eventuell",
            "inkl.": "inklusive", "ggf.": "gegebenenfalls", "u.a.": "unter anderem",
            "etc.": "et cetera", "vgl.": "vergleiche",
        },
        one_before_noun="ein",
        extra={"&": "und"},
    ),
    "es": _Lang(
        "es", ",", ".", "coma", "con", "a", "por ciento", "más", "punto", "arroba", "barra",
        "guion", "guion bajo",
        ("enero", "febrero", "marzo", "abril", "mayo", "junio", "julio", "agosto", "septiembre",
         "octubre", "noviembre", "diciembre"),
        {
            "$": ("dólar", "dólares", "centavo", "centavos"),
            "€": ("euro", "euros", "céntimo", "céntimos"),
            "£": ("libra", "libras", "penique", "peniques"),
            "¥": ("yen", "yenes", "sen", "sen"),
        },
        {
            "km/h": ("kilómetro por hora", "kilómetros por hora"), "km": ("kilómetro",
            "kilómetros"), "cm": ("centímetro", "centímetros"), "mm": ("milímetro",
            "milímetros"), "m": ("metro", "metros"), "kg": ("kilo", "kilos"),
            "mg": ("miligramo", "miligramos"), "g": ("gramo", "gramos"), "ml": ("mililitro",
            "mililitros"), "l": ("litro", "litros"), "°C": ("grado Celsius", "grados Celsius"),
            "°": ("grado", "grados"), "ms": ("milisegundo", "milisegundos"), "min": ("minuto",
            "minutos"), "h": ("hora", "horas"), "s": ("segundo", "segundos"),
            "kWh": ("kilovatio hora", "kilovatios hora"), "kW": ("kilovatio", "kilovatios"),
            "W": ("vatio", "vatios"), "V": ("voltio", "voltios"), "TB": ("terabyte",
            "terabytes"), "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"),
            "GHz": ("gigahercio", "gigahercios"), "MHz": ("megahercio", "megahercios"),
            "Hz": ("hercio", "hercios"),
        },
        {
            "Sr.": "señor", "Sra.": "señora", "Srta.": "señorita", "Dr.": "doctor",
            "Dra.": "doctora", "Ud.": "usted", "Uds.": "ustedes", "etc.": "etcétera",
            "p. ej.": "por ejemplo", "aprox.": "aproximadamente", "núm.": "número",
            "Avda.": "avenida", "Av.": "avenida", "c/": "calle", "Prof.": "profesor",
        },
        one_before_noun="un",
        extra={"&": "y"},
    ),
    "it": _Lang(
        "it", ",", ".", "virgola", "e", "a", "per cento", "più", "punto", "chiocciola", "barra",
        "trattino", "trattino basso",
        ("gennaio", "febbraio", "marzo", "aprile", "maggio", "giugno", "luglio", "agosto",
         "settembre", "ottobre", "novembre", "dicembre"),
        {
            "$": ("dollaro", "dollari", "centesimo", "centesimi"),
            "€": ("euro", "euro", "centesimo", "centesimi"),
            "£": ("sterlina", "sterline", "penny", "pence"),
            "¥": ("yen", "yen", "sen", "sen"),
        },
        {
            "km/h": ("chilometro orario", "chilometri orari"), "km": ("chilometro",
            "chilometri"), "cm": ("centimetro", "centimetri"), "mm": ("millimetro",
            "millimetri"), "m": ("metro", "metri"), "kg": ("chilo", "chili"),
            "mg": ("milligrammo", "milligrammi"), "g": ("grammo", "grammi"), "ml": ("millilitro",
            "millilitri"), "l": ("litro", "litri"), "°C": ("grado Celsius", "gradi Celsius"),
            "°": ("grado", "gradi"), "ms": ("millisecondo", "millisecondi"), "min": ("minuto",
            "minuti"), "h": ("ora", "ore"), "s": ("secondo", "secondi"), "kWh": ("chilowattora",
            "chilowattora"), "kW": ("chilowatt", "chilowatt"), "W": ("watt", "watt"),
            "V": ("volt", "volt"), "TB": ("terabyte", "terabyte"), "GB": ("gigabyte",
            "gigabyte"), "MB": ("megabyte", "megabyte"), "GHz": ("gigahertz", "gigahertz"),
            "MHz": ("megahertz", "megahertz"), "Hz": ("hertz", "hertz"),
        },
        {
            "Sig.ra": "signora", "Sig.na": "signorina", "Sig.": "signor", "Dott.ssa": "dottoressa",
            "Dott.": "dottor", "Prof.ssa": "professoressa", "Prof.": "professor",
            "Ing.": "ingegner", "Avv.": "avvocato", "ecc.": "eccetera", "ad es.": "ad esempio",
            "ca.": "circa", "pag.": "pagina",
        },
        one_before_noun="un",
        extra={"&": "e"},
    ),
    "pt": _Lang(
        "pt", ",", ".", "vírgula", "e", "a", "por cento", "mais", "ponto", "arroba", "barra",
        "hífen", "sublinhado",
        ("janeiro", "fevereiro", "março", "abril", "maio", "junho", "julho", "agosto", "setembro",
         "outubro", "novembro", "dezembro"),
        {
            "$": ("dólar", "dólares", "cêntimo", "cêntimos"),
            "€": ("euro", "euros", "cêntimo", "cêntimos"),
            "£": ("libra", "libras", "pêni", "pence"),
            "¥": ("iene", "ienes", "sen", "sen"),
            "R$": ("real", "reais", "centavo", "centavos"),
        },
        {
            "km/h": ("quilómetro por hora", "quilómetros por hora"), "km": ("quilómetro",
            "quilómetros"), "cm": ("centímetro", "centímetros"), "mm": ("milímetro",
            "milímetros"), "m": ("metro", "metros"), "kg": ("quilo", "quilos"),
            "mg": ("miligrama", "miligramas"), "g": ("grama", "gramas"), "ml": ("mililitro",
            "mililitros"), "l": ("litro", "litros"), "°C": ("grau Celsius", "graus Celsius"),
            "°": ("grau", "graus"), "ms": ("milissegundo", "milissegundos"), "min": ("minuto",
            "minutos"), "h": ("hora", "horas"), "s": ("segundo", "segundos"),
            "kWh": ("quilowatt-hora", "quilowatts-hora"), "kW": ("quilowatt", "quilowatts"),
            "W": ("watt", "watts"), "V": ("volt", "volts"), "TB": ("terabyte", "terabytes"),
            "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"),
            "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"),
            "Hz": ("hertz", "hertz"),
        },
        {
            "Sr.": "senhor", "Sra.": "senhora", "Dr.": "doutor", "Dra.": "doutora",
            "Prof.": "professor", "etc.": "etcétera", "p. ex.": "por exemplo",
            "aprox.": "aproximadamente", "nº": "número", "Av.": "avenida", "V. Exa.":
            "Vossa Excelência",
        },
        one_before_noun="um",
        extra={"&": "e"},
    ),
    "nl": _Lang(
        "nl", ",", ".", "komma", "en", "tot", "procent", "plus", "punt", "apenstaartje", "slash",
        "streepje", "laag streepje",
        ("januari", "februari", "maart", "april", "mei", "juni", "juli", "augustus", "september",
         "oktober", "november", "december"),
        {
            "$": ("dollar", "dollar", "cent", "cent"),
            "€": ("euro", "euro", "cent", "cent"),
            "£": ("pond", "pond", "penny", "pence"),
            "¥": ("yen", "yen", "sen", "sen"),
        },
        {
            "km/u": ("kilometer per uur", "kilometer per uur"), "km/h": ("kilometer per uur",
            "kilometer per uur"), "km": ("kilometer", "kilometer"), "cm": ("centimeter",
            "centimeter"), "mm": ("millimeter", "millimeter"), "m": ("meter", "meter"),
            "kg": ("kilo", "kilo"), "mg": ("milligram", "milligram"), "g": ("gram", "gram"),
            "ml": ("milliliter", "milliliter"), "l": ("liter", "liter"), "°C": ("graad Celsius",
            "graden Celsius"), "°": ("graad", "graden"), "ms": ("milliseconde",
            "milliseconden"), "min": ("minuut", "minuten"), "u": ("uur", "uur"),
            "s": ("seconde", "seconden"), "kWh": ("kilowattuur", "kilowattuur"),
            "kW": ("kilowatt", "kilowatt"), "W": ("watt", "watt"), "V": ("volt", "volt"),
            "TB": ("terabyte", "terabyte"), "GB": ("gigabyte", "gigabyte"), "MB": ("megabyte",
            "megabyte"), "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"),
            "Hz": ("hertz", "hertz"),
        },
        {
            "dhr.": "de heer", "mevr.": "mevrouw", "dr.": "dokter", "Dr.": "dokter",
            "prof.": "professor", "bijv.": "bijvoorbeeld", "bv.": "bijvoorbeeld",
            "enz.": "enzovoort", "d.w.z.": "dat wil zeggen", "o.a.": "onder andere",
            "nr.": "nummer", "ca.": "circa", "m.b.t.": "met betrekking tot", "etc.": "et cetera",
        },
        extra={"&": "en"},
    ),
}  # fmt: skip


# Lowercased words that a number after them belongs to ("$ 5", "No. 5", "May 3"): the clause
# splitter never cuts between the two.
WORDS_BEFORE_NUMBERS = frozenset(
    {"$", "€", "£", "¥", "#", "no.", "nr.", "n°", "nº", "núm.", "n.", "tel.", "tel:", "ca."}
    | {"approx.", "jan.", "feb.", "mar.", "apr.", "jun.", "jul.", "aug.", "sep.", "sept."}
    | {"oct.", "nov.", "dec."}
    | {month.lower() for lang in _LANGS.values() for month in lang.months}
)


# --- numbers


@lru_cache(maxsize=4096)
def _cardinal(n: int, lang: str) -> str:
    return num2words(n, lang=lang).replace(",", "")


@lru_cache(maxsize=1024)
def _ordinal(n: int, lang: str) -> str:
    return num2words(n, lang=lang, to="ordinal").replace(",", "")


@lru_cache(maxsize=512)
def _year(n: int, lang: str) -> str:
    return num2words(n, lang=lang, to="year").replace(",", "")


def _digits(digits: str, lang: str) -> str:
    return " ".join(_cardinal(int(d), lang) for d in digits if d.isdigit())


def _decimal(integer: str, fraction: str, lang: str) -> str:
    """ "3.05" -> "three point zero five": the fraction digit by digit, as people read it."""
    words = _cardinal(int(integer or "0"), lang)
    return f"{words} {_LANGS[lang].point} {_digits(fraction, lang)}"


def _to_number(text: str, lang: str) -> tuple[str, str] | None:
    """(integer digits, fraction digits) of a written number in the language's convention."""
    L = _LANGS[lang]
    text = text.replace("\u202f", " ").replace("\u00a0", " ")
    thousands = re.fullmatch(
        r"\d{1,3}(?:"
        + re.escape(L.thousands_sep)
        + r"\d{3})+(?:"
        + re.escape(L.decimal_sep)
        + r"(\d+))?",
        text,
    )
    if thousands:
        integer = re.sub(r"\D", "", text.split(L.decimal_sep)[0])
        return integer, thousands.group(1) or ""
    if lang == "fr":
        spaced = re.fullmatch(r"\d{1,3}(?: \d{3})+(?:,(\d+))?", text)
        if spaced:
            return re.sub(r"\D", "", text.split(",")[0]), spaced.group(1) or ""
    m = re.fullmatch(r"(\d*)(?:[.,](\d+))?", text)
    if m and (m.group(1) or m.group(2)):
        # A "." decimal in a comma-decimal language ("3.5" in French) is still a decimal: a
        # thousands group would have three digits, and that case matched above.
        return m.group(1), m.group(2) or ""
    return None


def _number_words(text: str, lang: str) -> str:
    parsed = _to_number(text, lang)
    if parsed is None:
        return text
    integer, fraction = parsed
    if fraction:
        return _decimal(integer, fraction, lang)
    if len(integer) > 1 and integer.startswith("0") or len(integer) > 15:
        return _digits(integer, lang)  # "007", account numbers: digit by digit
    return _cardinal(int(integer), lang)


def _count_is_one(text: str, lang: str) -> bool:
    parsed = _to_number(text, lang)
    return parsed is not None and parsed[1] == "" and parsed[0].lstrip("0") == "1"


def _counted(number: str, singular: str, plural: str, lang: str) -> str:
    """ "1 km" -> "one kilometer", "5 km" -> "five kilometers"."""
    if _count_is_one(number, lang):
        one = _LANGS[lang].one_before_noun or _cardinal(1, lang)
        return f"{one} {singular}"
    return f"{_number_words(number, lang)} {plural}"


# A written number: digits with optional thousands groups ("," "." or a space) and decimals.
_NUM = r"\d+(?:[.,\u00a0\u202f ]\d{3})*(?:[.,]\d+)?"
_NUM_TIGHT = r"\d+(?:[.,]\d{3})*(?:[.,]\d+)?"  # no space groups: "5 000" vs "5 km"


# --- markdown and emoji

_MARKDOWN: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"```[^\n`]*\n?|```"), " "),
    (re.compile(r"`([^`]*)`"), r"\1"),
    (re.compile(r"!\[([^\]]*)\]\([^)]*\)"), r"\1"),
    (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),
    (re.compile(r"^\s{0,3}#{1,6}\s+", re.M), ""),
    (re.compile(r"^\s{0,3}>\s?", re.M), ""),
    (re.compile(r"^\s*(?:[-*+•]|\d+[.)])\s+", re.M), ""),
    (re.compile(r"^\s*[-*_=]{3,}\s*$", re.M), " "),
    (re.compile(r"\*\*(.+?)\*\*|__(.+?)__"), r"\1\2"),
    (re.compile(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])"), r"\1"),
    (re.compile(r"(?<![\w_])_(?!\s)(.+?)(?<!\s)_(?![\w_])"), r"\1"),
    (re.compile(r"~~(.+?)~~"), r"\1"),
    (re.compile(r"\s*\|\s*"), ", "),
]
_EMOJI = re.compile(
    "[\U0001f000-\U0001faff\U00002600-\U000027bf\U0001f1e6-\U0001f1ff\U00002b00-\U00002bff"
    "\ufe0f\u200d\u20e3\U000e0020-\U000e007f]+"
)


def _strip_markdown(text: str) -> str:
    for pattern, repl in _MARKDOWN:
        text = pattern.sub(repl, text)
    return text.strip(" ,")


# --- URLs and e-mail

_TLDS = "com|org|net|io|ai|dev|app|edu|gov|eu|co|uk|fr|de|es|it|pt|nl|be|ch|at|br|info"
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_URL = re.compile(
    r"(?:https?://|www\.)[^\s<>\"']+|(?<![\w@.-])[\w-]+(?:\.[\w-]+)*\.(?:" + _TLDS + r")\b"
    r"(?:/[^\s<>\"']*)?",
    re.I,
)


def _spell_address(text: str, lang: str) -> str:
    L = _LANGS[lang]
    text = re.sub(r"^https?://", "", text, flags=re.I).rstrip("/")
    text = re.sub(r"^www\.", "w w w.", text, flags=re.I)
    out = []
    for part in re.split(r"([./@_-])", text):
        if part == ".":
            out.append(L.dot)
        elif part == "/":
            out.append(L.slash)
        elif part == "@":
            out.append(L.at)
        elif part == "_":
            out.append(L.underscore)
        elif part == "-":
            out.append(L.dash)
        elif part:
            # Letters stay (the model reads words); digits and symbols are spelled out.
            part = re.sub(r"\d+", lambda m: " " + _digits(m.group(), lang) + " ", part)
            part = part.replace("?", " ").replace("=", " ").replace("&", " ").replace("#", " ")
            out.append(" ".join(part.split()))
    return " ".join(p for p in out if p)


def _addresses(text: str, lang: str) -> str:
    def url(m: re.Match[str]) -> str:
        raw = m.group()
        core = raw.rstrip(".,;:!?)]}'\"")
        return _spell_address(core, lang) + raw[len(core) :]

    text = _EMAIL.sub(lambda m: _spell_address(m.group(), lang), text)
    return _URL.sub(url, text)


# --- dates and times


_DATIVE = {"am", "vom", "zum", "dem", "beim", "ab", "bis"}


def _german_ending(m: re.Match[str]) -> str:
    """German "am 3. Mai" is "am dritten Mai", "der 3. Mai" "der dritte", "3. Mai" "dritter"."""
    before = m.string[: m.start()].split()
    word = before[-1].lower() if before else ""
    return "n" if word in _DATIVE else "" if word in ("der", "die", "das") else "r"


def _day_words(day: int, lang: str, ending: str = "r") -> str:
    if lang == "en":
        return _ordinal(day, lang)
    if lang == "fr" and day == 1:
        return "premier"
    if lang == "de":
        return _ordinal(day, lang) + ending  # "dreißigster November"
    return _cardinal(day, lang)


def _date_words(year: int | None, month: int, day: int | None, lang: str, ending: str = "r") -> str:
    L = _LANGS[lang]
    name = L.months[month - 1]
    if lang == "en":
        parts = [name] if day is None else [name, _day_words(day, lang)]
        text = " ".join(parts)
        return text if year is None else f"{text}, {_year(year, lang)}"
    linker = " de " if lang in ("es", "pt") else " "
    text = name if day is None else f"{_day_words(day, lang, ending)}{linker}{name}"
    return text if year is None else f"{text}{linker}{_year(year, lang)}"


_ISO_DATE = re.compile(r"(?<![\d.-])(\d{4})-(\d{2})-(\d{2})(?![\d-])")
_NUMERIC_DATE = re.compile(r"(?<![\d./-])(\d{1,2})([./-])(\d{1,2})\2(\d{4})(?![\d/-]|\.\d)")


def _dates(text: str, lang: str) -> str:
    L = _LANGS[lang]

    def iso(m: re.Match[str]) -> str:
        year, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if 1 <= month <= 12 and 1 <= day <= 31:
            return _date_words(year, month, day, lang, _german_ending(m))
        return m.group()

    def numeric(m: re.Match[str]) -> str:
        a, b, year = int(m.group(1)), int(m.group(3)), int(m.group(4))
        month, day = (a, b) if lang == "en" else (b, a)
        if month > 12 and day <= 12:
            month, day = day, month
        if 1 <= month <= 12 and 1 <= day <= 31:
            return _date_words(year, month, day, lang, _german_ending(m))
        return m.group()

    text = _ISO_DATE.sub(iso, text)
    text = _NUMERIC_DATE.sub(numeric, text)
    months = "|".join(L.months) + ("|Sept" if lang == "en" else "")
    if lang == "en":
        text = _DECADE.sub(_decade, text)
        # "November 30", "November 30th, 2026", "30 November 2026", "November 2026".
        pattern = re.compile(
            r"\b(" + months + r")\.?\s+(\d{1,2})(?:st|nd|rd|th)?\b(?:,?\s+(\d{4})\b)?"
        )

        def month_day(m: re.Match[str]) -> str:
            day = int(m.group(2))
            if not 1 <= day <= 31:
                return m.group()
            year = int(m.group(3)) if m.group(3) else None
            return _date_words(year, _month_index(m.group(1), lang), day, lang)

        text = pattern.sub(month_day, text)
    day_suffix = {"en": r"(?:st|nd|rd|th)?", "de": r"\.?", "fr": r"(?:er)?"}.get(lang, "")
    pattern = re.compile(
        r"\b(\d{1,2})"
        + day_suffix
        + r"\s+(?:de\s+)?("
        + months
        + r")\b(?:\s+(?:de\s+)?(\d{4})\b)?",
        re.I,
    )

    def day_month(m: re.Match[str]) -> str:
        day = int(m.group(1))
        if not 1 <= day <= 31:
            return m.group()
        year = int(m.group(3)) if m.group(3) else None
        return _date_words(year, _month_index(m.group(2), lang), day, lang, _german_ending(m))

    text = pattern.sub(day_month, text)
    month_year = re.compile(r"\b(" + months + r")\s+(\d{4})\b", re.I)
    return month_year.sub(
        lambda m: f"{L.months[_month_index(m.group(1), lang) - 1]} {_year(int(m.group(2)), lang)}",
        text,
    )


_DECADE = re.compile(r"(?<![\w.,])(?:'|\u2019)?((?:1[0-9]|20)?\d)0s\b")


def _decade(m: re.Match[str]) -> str:
    """ "1990s" -> "nineteen nineties", "'80s" -> "eighties"."""
    digits = m.group(1)
    if len(digits) == 1:
        words = _cardinal(int(digits) * 10, "en")
    else:
        words = _year(int(digits + "0"), "en")
    return re.sub(r"ty$", "ties", words) if words.endswith("ty") else words + "s"


def _month_index(name: str, lang: str) -> int:
    name = name.lower()
    if name == "sept":
        return 9
    return [m.lower() for m in _LANGS[lang].months].index(name) + 1


# "p.m." or "pm.": the last period may also end the sentence; `_keep_stop` decides.
_AMPM = r"(?:\s*([AaPp])\.?\s?[Mm](\.?)(?!\w))"
# German "15:30 Uhr" and Dutch "15:30 uur" already name the hour: the word is read once.
_TIME = re.compile(
    r"(?<![\d:.])(\d{1,2}):(\d{2})(?::\d{2})?(?!\d)(?:" + _AMPM + r"|\s+(?:Uhr|uur)\b)?"
)
_DOT_TIME = re.compile(r"(?<![\d:.,])(\d{1,2})\.(\d{2})\s+(?:Uhr|uur)\b")
_CLOCK_AMPM = re.compile(r"(?<![\d:.])(\d{1,2})" + _AMPM)
_FR_TIME = re.compile(r"(?<![\d:.])(\d{1,2})\s?h\s?(\d{2})?(?!\w)")


def _hour_words(hour: int, lang: str) -> str:
    if hour == 1 and lang in ("es", "it"):
        return "una"
    if hour == 1 and lang == "fr":
        return "une"
    if hour == 1 and lang == "pt":
        return "uma"
    if hour == 1 and lang == "de":
        return "ein"
    return _cardinal(hour, lang)


def _time_words(hour: int, minute: int, ampm: str | None, lang: str) -> str:
    L = _LANGS[lang]
    h = _hour_words(hour, lang)
    m = _cardinal(minute, lang)
    if lang == "en":
        if minute == 0:
            spoken = h if ampm else f"{h} o'clock"
        elif minute < 10:
            spoken = f"{h} oh {m}"
        else:
            spoken = f"{h} {m}"
        if ampm:
            spoken += " " + (L.am if ampm.lower() == "a" else L.pm)
        return spoken
    if lang == "fr":
        heure = "heure" if hour in (0, 1) else "heures"
        return f"{h} {heure}" + ("" if minute == 0 else f" {m}")
    if lang == "de":
        return f"{h} Uhr" + ("" if minute == 0 else f" {m}")
    if lang == "nl":
        return f"{h} uur" + ("" if minute == 0 else f" {m}")
    if lang == "pt":
        if minute == 0:
            return f"{h} hora" if hour == 1 else f"{h} horas"
        return f"{h} e {m}"
    tail = "en punto" if lang == "es" else "in punto"
    return f"{h} {tail}" if minute == 0 else f"{h} y {m}" if lang == "es" else f"{h} e {m}"


def _times(text: str, lang: str) -> str:
    def keep_stop(m: re.Match[str], stop: str | None) -> str:
        """The period of "pm." ends the sentence when the text ends or a capital follows."""
        rest = m.string[m.end() :]
        ends = not rest.strip() or rest[:1].isspace() and rest[1:2].isupper()
        return "." if stop and ends else ""

    def clock(m: re.Match[str]) -> str:
        hour, minute = int(m.group(1)), int(m.group(2))
        if hour > 24 or minute > 59:
            return m.group()
        ampm, stop = (m.groups() + (None, None))[2:4]
        return _time_words(hour, minute, ampm, lang) + keep_stop(m, stop)

    def hour_only(m: re.Match[str]) -> str:
        if int(m.group(1)) > 12:
            return m.group()
        return _time_words(int(m.group(1)), 0, m.group(2), lang) + keep_stop(m, m.group(3))

    text = _TIME.sub(clock, text)
    if lang in ("de", "nl"):
        text = _DOT_TIME.sub(clock, text)
    if lang == "en":
        text = _CLOCK_AMPM.sub(hour_only, text)
    if lang == "fr":
        text = _FR_TIME.sub(
            lambda m: (
                _time_words(int(m.group(1)), int(m.group(2) or 0), None, lang)
                if int(m.group(1)) <= 24
                else m.group()
            ),
            text,
        )
    return text


# --- phone numbers, money, percentages, ordinals, units

_PHONE = re.compile(
    r"(?<![\w.,+-])(\+\s?)?(\(\d{1,4}\)\s?)?\d{1,4}(?:[ .-]\(?\d{1,8}\)?){1,5}(?![\w.,-]?\d)"
)


def _is_phone(raw: str, plus: bool, parens: bool, lang: str) -> bool:
    digits = re.sub(r"\D", "", raw)
    if len(digits) < 7:
        return False
    if plus or parens or "-" in raw:
        return True
    groups = re.findall(r"\d+", raw)
    separators = set(re.sub(r"[\d()]", "", raw))
    thousands = {_LANGS[lang].thousands_sep} | ({" "} if lang == "fr" else set())
    # "1 234 567" (French) and "1.234.567" are numbers with thousands groups; "06 12 34 56 78"
    # and "912 345 678" (written with spaces where spaces are no thousands mark) are not.
    return (
        not separators <= thousands
        or any(len(g) != 3 for g in groups[1:])
        or (len(groups[0]) > 1 and groups[0][0] == "0")
    )


def _phones(text: str, lang: str) -> str:
    L = _LANGS[lang]

    def phone(m: re.Match[str]) -> str:
        raw = m.group()
        trailing = raw[len(raw.rstrip(" ")) :]
        if not _is_phone(raw.strip(), bool(m.group(1)), bool(m.group(2)), lang):
            return raw
        groups = [_digits(g, lang) for g in re.findall(r"\d+", raw)]
        spoken = ", ".join(groups)
        return (f"{L.plus} " if m.group(1) else "") + spoken + trailing

    return _PHONE.sub(phone, text)


_SCALE_WORDS = {
    "en": ("thousand", "million", "billion", "trillion"),
    "fr": ("mille", "million", "millions", "milliard", "milliards"),
    "de": ("Tausend", "Million", "Millionen", "Milliarde", "Milliarden"),
    "es": ("mil", "millón", "millones"),
    "it": ("mila", "milione", "milioni", "miliardo", "miliardi"),
    "pt": ("mil", "milhão", "milhões", "bilião", "biliões", "bilhão", "bilhões"),
    "nl": ("duizend", "miljoen", "miljard"),
}
_SYMBOLS = "|".join(re.escape(s) for s in ("R$", "$", "€", "£", "¥"))


def _money(text: str, lang: str) -> str:
    L = _LANGS[lang]
    scales = "|".join(_SCALE_WORDS[lang])

    def say(symbol: str, amount: str, scale: str | None) -> str:
        symbol = _CURRENCY_CODES.get(symbol.upper(), symbol)
        names = L.currencies.get(symbol)
        if names is None:
            return f"{amount} {symbol}"
        unit, units, cent, cents = names
        if scale:  # "$1.5 million" -> "one point five million dollars"
            return f"{_number_words(amount, lang)} {scale} {units}"
        parsed = _to_number(amount, lang)
        if parsed is None:
            return amount
        integer, fraction = parsed
        if len(fraction) != 2:
            return _counted(amount, unit, units, lang)
        whole = _counted(integer or "0", unit, units, lang) if int(integer or "0") else ""
        change = _counted(str(int(fraction)), cent, cents, lang) if int(fraction) else ""
        if whole and change:
            return f"{whole} {L.and_} {change}"
        return whole or change or f"{_cardinal(0, lang)} {units}"

    prefix = re.compile(
        r"(?<!\w)("
        + _SYMBOLS
        + r"|USD|EUR|GBP|JPY)\s?("
        + _NUM_TIGHT
        + r")(?:\s+("
        + scales
        + r")\b)?"
    )
    suffix = re.compile(
        r"(?<![\w.,])("
        + _NUM
        + r")(?:\s+("
        + scales
        + r"))?\s?("
        + _SYMBOLS
        + r"|USD\b|EUR\b|GBP\b|JPY\b|euros?\b|dollars?\b)"
    )

    def after(m: re.Match[str]) -> str:
        symbol = m.group(3)
        word = {"euro": "€", "euros": "€", "dollar": "$", "dollars": "$"}.get(symbol.lower())
        if word and not m.group(0)[: len(m.group(1))].strip():
            return m.group()
        return say(word or symbol, m.group(1), m.group(2))

    text = prefix.sub(lambda m: say(m.group(1), m.group(2), m.group(3)), text)
    return suffix.sub(
        lambda m: after(m) if not m.group(3)[0].isalpha() else _words_currency(m, lang, say),
        text,
    )


def _words_currency(m: re.Match[str], lang: str, say: Callable[..., str]) -> str:
    """ "12.50 euros": the amount is read as money only with cents; else as a plain count."""
    symbol = {"euro": "€", "euros": "€", "dollar": "$", "dollars": "$"}.get(m.group(3).lower())
    parsed = _to_number(m.group(1), lang)
    if symbol and parsed and len(parsed[1]) == 2 and not m.group(2):
        return say(symbol, m.group(1), None)
    return m.group()


def _percent(text: str, lang: str) -> str:
    L = _LANGS[lang]
    pattern = re.compile(r"(?<![\w.,])(-?)(" + _NUM_TIGHT + r")\s?%")

    def say(m: re.Match[str]) -> str:
        sign = _minus(lang) + " " if m.group(1) else ""
        return f"{sign}{_number_words(m.group(2), lang)} {L.percent}"

    return pattern.sub(say, text)


def _minus(lang: str) -> str:
    return _cardinal(-1, lang).rsplit(" ", 1)[0]


_ORDINAL_SUFFIX = {
    "en": r"(?:st|nd|rd|th)",
    "fr": r"(?:er|re|ère|ème|eme|e)",
    "es": r"(?:\.?[ºª°])",
    "it": r"(?:\.?[ºª°])",
    "pt": r"(?:\.?[ºª°])",
    "nl": r"(?:ste|de|e)",
}


def _ordinals(text: str, lang: str) -> str:
    if lang == "de":
        # "der 3. Platz": a number with a period, then a lowercase word or a noun, mid-sentence.
        pattern = re.compile(r"(?<=\w )(\d{1,3})\.(?= [a-zäöüß]|\s[A-ZÄÖÜ][a-zäöüß]+\b(?!\s*$))")
        return pattern.sub(lambda m: _ordinal(int(m.group(1)), lang), text)
    suffix = _ORDINAL_SUFFIX[lang]
    pattern = re.compile(r"(?<![\w.,])(\d+)(" + suffix + r")(?!\w)")

    def say(m: re.Match[str]) -> str:
        words = _ordinal(int(m.group(1)), lang)
        if lang == "fr" and m.group(2) in ("re", "ère") and words == "premier":
            return "première"
        if lang in ("es", "it", "pt") and "ª" in m.group(2):
            return " ".join(w[:-1] + "a" if w.endswith("o") else w for w in words.split())
        return words

    return pattern.sub(say, text)


def _units(text: str, lang: str) -> str:
    L = _LANGS[lang]
    names = sorted(L.units, key=len, reverse=True)
    pattern = re.compile(
        r"(?<![\w.,])(-?)("
        + _NUM_TIGHT
        + r")\s?("
        + "|".join(re.escape(u) for u in names)
        + r")(?![\w/²³])"
    )

    def say(m: re.Match[str]) -> str:
        singular, plural = L.units[m.group(3)]
        sign = _minus(lang) + " " if m.group(1) else ""
        return sign + _counted(m.group(2), singular, plural, lang)

    return pattern.sub(say, text)


# --- abbreviations and symbols


@lru_cache(maxsize=16)
def _abbreviation_pattern(lang: str) -> re.Pattern[str]:
    keys = set(_LANGS[lang].abbreviations)
    keys |= {k[0].upper() + k[1:] for k in keys}  # "bijv." opens a sentence as "Bijv."
    alternatives = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    return re.compile(r"(?<![\w.])(" + alternatives + r")(?!\w)")


def _expand(m: re.Match[str], table: dict[str, str]) -> str:
    key = m.group(1)
    words = table.get(key) or table[key[0].lower() + key[1:]]
    if key.endswith(".") and not m.string[m.end() :].strip():
        words += "."  # the period of a final "etc." also ends the sentence
    return words


_NUMBER_SIGN = {
    "en": "number",
    "fr": "numéro",
    "de": "Nummer",
    "es": "número",
    "it": "numero",
    "pt": "número",
    "nl": "nummer",
}


def _saint_or_street(m: re.Match[str]) -> str:
    """ "St." is "Street" after a house number ("221B Baker St."), else before a name "Saint"."""
    before = m.string[: m.start()].split()[-2:]
    after = m.string[m.end() :].lstrip()
    if any(any(c.isdigit() for c in w) for w in before) or not after[:1].isupper():
        return "Street"
    return "Saint"


_EQUALS = {
    "en": "equals",
    "fr": "égale",
    "de": "gleich",
    "es": "igual a",
    "it": "uguale a",
    "pt": "igual a",
    "nl": "is gelijk aan",
}


def _abbreviations(text: str, lang: str) -> str:
    L = _LANGS[lang]
    if lang == "en":
        # "No. 5" is "number five"; "St." before a name is "Saint", after one "Street".
        text = re.sub(r"\b[Nn]o\.\s?(?=\d)", "number ", text)
        text = re.sub(r"\bSt\.", _saint_or_street, text)
    text = re.sub(r"#\s?(?=\d)", _NUMBER_SIGN[lang] + " ", text)
    if lang == "it":
        text = re.sub(r"\b[Nn]\.\s?(?=\d)", "numero ", text)
    text = _abbreviation_pattern(lang).sub(lambda m: _expand(m, L.abbreviations), text)
    text = re.sub(r"(?<=\S) = (?=\S)", f" {_EQUALS[lang]} ", text)
    for symbol, word in L.extra.items():
        text = text.replace(f" {symbol} ", f" {word} ")
    text = re.sub(r"(?<=\d)\s?\+\s?(?=\d)", f" {L.plus} ", text)
    return text


# --- plain numbers


def _numbers(text: str, lang: str) -> str:
    L = _LANGS[lang]
    # Digits glued to letters ("221B", "mp3") are read apart.
    text = re.sub(r"(?<=\d)(?=[^\W\d_])|(?<=[^\W\d_])(?=\d)", " ", text)
    range_ = re.compile(r"(?<![\w.,-])(" + _NUM_TIGHT + r")\s?[-–]\s?(" + _NUM_TIGHT + r")(?!\w)")
    text = range_.sub(
        lambda m: f"{_number_words(m.group(1), lang)} {L.to} {_number_words(m.group(2), lang)}",
        text,
    )
    if lang == "en":
        year = re.compile(
            r"\b((?:[Ii]n|[Ss]ince|[Ff]rom|[Uu]ntil|[Bb]y|[Oo]f|[Yy]ear|[Bb]efore|[Aa]fter"
            r"|[Aa]round|[Ii]n the)\s+)(1[1-9]\d\d|20\d\d)\b(?![.,]\d)"
        )
        text = year.sub(lambda m: m.group(1) + _year(int(m.group(2)), lang), text)
    negative = re.compile(r"(?<![\w.,-])-(?=\d)")
    text = negative.sub(_minus(lang) + " ", text)
    spaced = r"\d{1,3}(?:[\u00a0\u202f ]\d{3})+(?:,\d+)?|" if lang == "fr" else ""
    number = re.compile(r"(?<![\d.,])(" + spaced + _NUM_TIGHT + r")(?!\d)")
    return number.sub(lambda m: _number_words(m.group(1), lang), text)


_SPACES = re.compile(r"[ \t]+")
_SPACE_BEFORE_MARK = re.compile(r"[ \t]+([.,!?;:])(?=\s|$)")


def normalize_text(text: str, language: str = "en") -> str:
    """The text as a reader would say it, in `language` (en, fr, de, es, it, pt, nl).

    Numbers, ordinals, decimals, currency, percentages, dates, times, phone numbers (digit by
    digit), units, common abbreviations, URLs and e-mail addresses become words; markdown and
    emoji are dropped. Text without any of these comes back unchanged (spaces aside).
    """
    lang = language.lower().split("-")[0].split("_")[0]
    if lang not in _LANGS:
        raise ValueError(f"unknown language {language!r}: expected one of {', '.join(LANGUAGES)}")
    text = _EMOJI.sub("", text)
    text = _strip_markdown(text)
    if any(c.isdigit() or c in "@./#&+$€£¥%" for c in text):
        text = _addresses(text, lang)
        text = _dates(text, lang)
        text = _times(text, lang)
        text = _phones(text, lang)
        text = _money(text, lang)
        text = _percent(text, lang)
        text = _ordinals(text, lang)
        text = _units(text, lang)
        text = _abbreviations(text, lang)
        text = _numbers(text, lang)
    else:
        text = _abbreviations(text, lang)
    text = _SPACE_BEFORE_MARK.sub(r"\1", text)
    return _SPACES.sub(" ", text).strip()
