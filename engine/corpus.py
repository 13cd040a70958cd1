"""A seeded generator of English-like sentences, the training text for the local tokenizer.

The released tokenizer cannot be fetched offline and no third-party corpus is shipped, so the
checkpoint maker trains its own SentencePiece model on text made here from word lists and
templates. It only has to look enough like English for a 4000-piece vocabulary to be reachable and
to give punctuation (. , ! ? ; :) and digits pieces of their own, as the text chunker expects.
Punctuation is always attached to the preceding word (never " ."), so "." is a piece but "▁." is
not, like in the released vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator


def _words(text: str) -> list[str]:
    return text.split()


_NOUNS = _words("""
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education foot boy age policy
music market sense nation plan college interest death experience effect class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple
site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population site garden river mountain ocean island forest valley bridge station airport
train bus bicycle engine kitchen bedroom window chair sofa lamp mirror blanket pillow clock candle
coffee tea bread butter cheese apple orange banana lemon tomato potato carrot onion garlic pepper
salt sugar honey soup salad sandwich pizza pasta rice chicken fish egg milk juice wine beer cake
cookie chocolate breakfast lunch dinner dog cat horse bird rabbit mouse lion tiger bear wolf fox
deer eagle owl snake turtle whale dolphin shark butterfly spider flower grass leaf seed root branch
rain snow wind storm cloud sun moon sky thunder weather summer winter spring autumn ticket letter
package message email meeting lesson homework exam teacher student library museum theater concert
hospital pharmacy bakery restaurant hotel market shop bank church school university factory farm
castle village harbor desert jungle beach lake canyon volcano planet galaxy rocket satellite robot
machine battery camera guitar piano violin drum song poem novel journal magazine newspaper chapter
sentence question answer problem solution secret promise dream memory journey adventure mystery
treasure map compass key lock box bag bottle cup glass plate spoon fork knife bowl basket bucket
hammer nail rope ladder shovel wheel tire mirror screen keyboard button signal network password
""")

_ADJECTIVES = _words("""
good new first last long great little own other old right big high different small large next
early young important few public bad same able late hard major better economic strong possible
whole free military true federal international full special easy clear recent certain personal
open red difficult available likely short single medical current wrong private past foreign fine
common poor natural significant similar hot dead central happy serious ready simple left physical
general environmental financial blue democratic dark various entire close legal religious cold
final main green nice huge popular traditional cultural quiet gentle bright brave calm careful
cheerful clever curious eager famous fancy friendly funny gorgeous helpful honest hungry jolly kind
lazy lively lucky mighty modern narrow nervous noisy polite proud rapid rare rich rough sharp shiny
silly smooth soft sour spicy steady sticky strange sweet tall tender thick thin tiny tired tough
warm weak wet wide wild wise wooden yellow purple silver golden ancient enormous fragile frozen
glorious hollow humble invisible magnetic massive mysterious peaceful perfect pleasant precious
""")

_VERBS = _words("""
ask build buy call carry change choose clean climb close cook count cover cross dance decide
deliver describe design discover draw dream drink drive eat enjoy explain fill find finish fix
fly follow forget give grow guess help hide hold hope hunt imagine invite join jump keep kick
know laugh learn leave lend lift like listen live look love make measure meet move need open
order paint pass pay pick plan plant play pour prepare promise protect pull push read remember
repair rest return ride run save say search see sell send share shout show sing sit sleep smile
solve speak spend stand start stay stop study swim take talk teach tell think throw touch travel
try turn understand use visit wait wake walk want wash watch wear win wish work worry write
""")

# Irregular past tenses; regular ones are made by _past().
_IRREGULAR_PAST = {
    "build": "built", "buy": "bought", "choose": "chose", "draw": "drew", "drink": "drank",
    "drive": "drove", "eat": "ate", "find": "found", "fly": "flew", "forget": "forgot",
    "give": "gave", "grow": "grew", "hide": "hid", "hold": "held", "keep": "kept",
    "know": "knew", "leave": "left", "lend": "lent", "make": "made", "meet": "met",
    "pay": "paid", "read": "read", "ride": "rode", "run": "ran", "say": "said", "see": "saw",
    "sell": "sold", "send": "sent", "sing": "sang", "sit": "sat", "sleep": "slept",
    "speak": "spoke", "spend": "spent", "stand": "stood", "swim": "swam", "take": "took",
    "teach": "taught", "tell": "told", "think": "thought", "throw": "threw",
    "understand": "understood", "wake": "woke", "wear": "wore", "win": "won", "write": "wrote",
}  # fmt: skip

_ADVERBS = _words("""
quickly slowly quietly loudly carefully happily sadly suddenly finally usually always never often
sometimes rarely really very quite almost already still again soon later today tomorrow yesterday
together alone outside inside everywhere somewhere nearly simply clearly gently badly easily
""")

_PREPOSITIONS = _words("in on at near behind under above beside across through around toward into")
_DETERMINERS = _words("the a this that my your his her our their every some one another")
_PRONOUNS = _words("I you he she we they")
_CONTRACTIONS = _words("I'm you're he's she's it's we're they're don't can't won't isn't didn't")
_INTERJECTIONS = _words("Oh Wow Well Hey Look Listen Yes No Okay Great Really Wait Hmm Alright")
_CONNECTORS = _words("however therefore meanwhile besides instead otherwise still then also")
_UNITS = _words(
    "minutes hours days weeks months years miles kilometers meters dollars euros pounds"
)
_WEEKDAYS = _words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
_MONTHS = _words(
    "January February March April May June July August September October November December"
)

# Syllables for made-up names of people and places: they widen the set of frequent substrings so
# that 4000 distinct pieces are worth keeping.
_ONSETS = _words("b br c ch d dr f g gr h j k l m n p pr r s sh st t th tr v w z")
_NUCLEI = _words("a e i o u ai ea ee oo ou ar er or an en in on")
_CODAS = ["", "", "", "n", "r", "s", "l", "th", "nd", "ck", "m", "x"]


def _past(verb: str) -> str:
    if verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


class _Maker:
    """Sentence templates over one `random.Random`, so the output is a function of the seed."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.names = [self._made_up_word().capitalize() for _ in range(300)]

    def _made_up_word(self) -> str:
        r = self.r
        return "".join(
            r.choice(_ONSETS) + r.choice(_NUCLEI) + r.choice(_CODAS) for _ in range(r.randint(1, 3))
        )

    def _noun_phrase(self) -> str:
        r = self.r
        noun = r.choice(_NOUNS)
        if r.random() < 0.3:
            return f"{r.choice(['the', 'some', 'many', 'two', 'three'])} {_plural(noun)}"
        adjective = f"{r.choice(_ADJECTIVES)} " if r.random() < 0.5 else ""
        return f"{r.choice(_DETERMINERS)} {adjective}{noun}"

    def _number(self) -> str:
        r = self.r
        kind = r.randrange(8)
        if kind == 0:
            return str(r.randint(0, 100))
        if kind == 1:
            return str(r.randint(1900, 2099))  # a year
        if kind == 2:
            return f"${r.randint(1, 999)}.{r.randint(0, 99):02d}"
        if kind == 3:
            return f"{r.randint(1, 12)}:{r.randint(0, 59):02d}"
        if kind == 4:
            return f"{r.randint(1, 99)}%"
        if kind == 5:
            return f"{r.randint(1, 999):,}" if r.random() < 0.5 else f"{r.randint(1000, 99999):,}"
        if kind == 6:
            n = r.randint(1, 31)
            suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10 if n not in (11, 12, 13) else 0, "th")
            return f"{n}{suffix}"
        return f"{r.randint(0, 9)}.{r.randint(0, 99)}"

    def _clause(self) -> str:
        r = self.r
        subject = r.choice([r.choice(_PRONOUNS), r.choice(self.names), self._noun_phrase()])
        verb = r.choice(_VERBS)
        templates: list[Callable[[], str]] = [
            lambda: f"{subject} {_past(verb)} {self._noun_phrase()}",
            lambda: f"{subject} will {verb} {self._noun_phrase()} {r.choice(_ADVERBS)}",
            lambda: f"{subject} {_past(verb)} {r.choice(_PREPOSITIONS)} {self._noun_phrase()}",
            lambda: f"{r.choice(_CONTRACTIONS)} going to {verb} {self._noun_phrase()}",
            lambda: f"{subject} waited {self._number()} {r.choice(_UNITS)}",
            lambda: f"{subject} paid {self._number()} for {self._noun_phrase()}",
            lambda: f"on {r.choice(_WEEKDAYS)} {subject} {_past(verb)} {r.choice(_ADVERBS)}",
            lambda: f"the meeting is at {self._number()} on {r.choice(_MONTHS)} {self._number()}",
            lambda: (
                f"{self._noun_phrase()} was {r.choice(_ADJECTIVES)} and {r.choice(_ADJECTIVES)}"
            ),
            lambda: f"{subject} met {r.choice(self.names)} in {r.choice(self.names)}",
        ]
        return r.choice(templates)()

    def sentence(self) -> str:
        r = self.r
        kind = r.randrange(10)
        if kind < 4:
            text, end = self._clause(), "."
        elif kind == 4:
            text, end = f"{self._clause()}, {r.choice(['and', 'but', 'so'])} {self._clause()}", "."
        elif kind == 5:
            text, end = f"{self._clause()}; {r.choice(_CONNECTORS)}, {self._clause()}", "."
        elif kind == 6:
            items = ", ".join(self._noun_phrase() for _ in range(r.randint(2, 4)))
            text, end = f"{self._clause()}: {items}", "."
        elif kind == 7:
            verb = r.choice(_VERBS)
            text = f"{r.choice(['do', 'did', 'can', 'will'])} {r.choice(_PRONOUNS)} {verb} "
            text += self._noun_phrase()
            end = "?"
        elif kind == 8:
            text, end = f"{r.choice(_INTERJECTIONS)}, {self._clause()}", "!"
        else:
            text, end = f'{r.choice(self.names)} said, "{self._clause()}', '..."'
        return text[0].upper() + text[1:] + end


def sentences(seed: int, count: int) -> Iterator[str]:
    """Yield `count` sentences, the same ones for the same seed."""
    maker = _Maker(seed)
    for _ in range(count):
        yield maker.sentence()
