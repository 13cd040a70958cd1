"""Seeded generators of sentences in each model language, the training text for local tokenizers.

The released tokenizers cannot be fetched offline and no third-party corpus is shipped, so the
checkpoint maker trains its own SentencePiece model on text made here from word lists and
templates. It only has to look enough like the language for a 4000-piece vocabulary to be
reachable and to give punctuation (. , ! ? ; :) and digits pieces of their own, as the text
chunker expects. Punctuation is always attached to the preceding word (never " ."), so "." is a
piece but "▁." is not, like in the released vocabulary. Every corpus ends with lines that hold
each character of the language's alphabet (with its diacritics, both cases), the digits and the
punctuation, so that a tokenizer trained on it has a piece for each (`ALPHABETS`).
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


# The letters of each model language beyond a-z, both cases.
_EXTRA_LETTERS = {
    "english": "",
    "french": "àâæçéèêëîïôœùûüÿ",
    "german": "äöüß",
    "spanish": "áéíóúñü",
    "italian": "àèéìíîòóùú",
    "portuguese": "áâãàçéêíóôõúü",
    "dutch": "áéíóúàèëïöü",
}
LANGUAGES = tuple(_EXTRA_LETTERS)
DIGITS = "0123456789"
PUNCTUATION = ".,!?;:'\"-()%$&/–—’«»¿¡€"


def alphabet(language: str) -> str:
    """Every letter of `language`, lower then upper case ("ß" has no single upper case)."""
    lower = "abcdefghijklmnopqrstuvwxyz" + _EXTRA_LETTERS[language]
    return lower + "".join(c.upper() for c in lower if len(c.upper()) == 1)


# Common words with the language's diacritics; made-up words from its letters widen the rest.
_WORDS = {
    "french": _words("""
le la les un une des et mais ou donc car est était sont avec pour dans sur sous chez très déjà
où là à ça élève école fenêtre forêt garçon français père mère frère sœur cœur œuvre noël maïs
naïf hôtel hôpital île château août crème bientôt fête être même après voilà aujourd'hui
l'été qu'il c'est n'est j'ai économie société vérité liberté égalité musée théâtre café thé
journée soirée matin nuit jour ville pays monde maison voiture chemin rivière montagne mer plage
soleil lune étoile pluie neige vent froid chaud beau grand petit jeune vieux nouveau heureux
triste rapide lent parler manger boire aller venir voir savoir pouvoir vouloir faire dire
prendre donner trouver penser aimer chercher où dû sûr goût piqûre ambiguë aïeul Ève Élise
"""),
    "german": _words("""
der die das ein eine und aber oder weil ist war sind mit für in auf unter bei sehr schon über
für Mädchen Junge Straße Fuß groß klein schön müde früh spät Bäcker Brötchen Käse Äpfel Öl
Übung Tür Zimmer Stadt Land Welt Haus Auto Weg Fluss Berg Meer Strand Sonne Mond Stern Regen
Schnee Wind kalt warm alt neu glücklich traurig schnell langsam sprechen essen trinken gehen
kommen sehen wissen können wollen machen sagen nehmen geben finden denken lieben suchen heißen
während zurück natürlich Grüße Gemüse Brücke Mädchenname Fräulein Österreich Übersee Ärger
"""),
    "spanish": _words("""
el la los las un una y pero o porque es era son con para en sobre bajo muy ya más también aquí
allí niño niña año mañana señor señora corazón canción nación educación información café música
árbol lápiz fácil difícil rápido película médico teléfono pingüino vergüenza cigüeña España
ciudad país mundo casa coche camino río montaña mar playa sol luna estrella lluvia nieve viento
frío caliente viejo nuevo feliz triste lento hablar comer beber ir venir ver saber poder querer
hacer decir tomar dar encontrar pensar amar buscar cómo qué cuándo dónde quién está están él tú
"""),
    "italian": _words("""
il lo la i gli le un una e ma o perché è era sono con per in su sotto molto già più anche qui
là città università perché così però virtù caffè tè più giù lunedì martedì venerdì ragazzo
ragazza anno mattina sera notte giorno paese mondo casa macchina strada fiume montagna mare
spiaggia sole luna stella pioggia neve vento freddo caldo bello grande piccolo giovane vecchio
nuovo felice triste veloce lento parlare mangiare bere andare venire vedere sapere potere volere
fare dire prendere dare trovare pensare amare cercare età verità libertà novità attività bontà
"""),
    "portuguese": _words("""
o a os as um uma e mas ou porque é era são com para em sobre sob muito já mais também aqui ali
não então irmão irmã mãe pão coração canção nação educação informação você avô avó português
café música árvore fácil difícil rápido médico telefone água três mês país cidade mundo casa
carro caminho rio montanha mar praia sol lua estrela chuva neve vento frio quente velho novo
feliz triste lento falar comer beber ir vir ver saber poder querer fazer dizer tomar dar
encontrar pensar amar procurar está estão até após através também lição opção manhã amanhã
"""),
    "dutch": _words("""
de het een en maar of omdat is was zijn met voor in op onder bij heel al meer ook hier daar
café één twee drie vier ideeën zeeën geïnteresseerd geïrriteerd reünie coördinatie België
knieën financiële misère crème à la carte ruïne naïef hè vóór dóór wél níet stad land wereld
huis auto weg rivier berg zee strand zon maan ster regen sneeuw wind koud warm oud nieuw blij
verdrietig snel langzaam praten eten drinken gaan komen zien weten kunnen willen maken zeggen
nemen geven vinden denken houden zoeken meisje jongen straat kind school fiets boterham kaas
"""),
}


class _WordsMaker:
    """Sentences in a language other than English: its words, made-up words from its letters,
    numbers and punctuation, over one `random.Random`."""

    def __init__(self, seed: int, language: str) -> None:
        self.r = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz" + _EXTRA_LETTERS[language]
        vowels = "aeiouy" + _EXTRA_LETTERS[language]
        consonants = [c for c in letters if c not in vowels]
        r = self.r
        made_up = [
            "".join(
                r.choice(consonants) + r.choice(vowels) + r.choice(["", "", r.choice(consonants)])
                for _ in range(r.randint(1, 3))
            )
            for _ in range(3000)
        ]
        self.words = _WORDS[language] * 8 + made_up
        self.names = [w.capitalize() for w in made_up[:300]]

    def _number(self) -> str:
        r = self.r
        kind = r.randrange(5)
        if kind == 0:
            return str(r.randint(0, 100))
        if kind == 1:
            return str(r.randint(1900, 2099))
        if kind == 2:
            return f"{r.randint(1, 999)},{r.randint(0, 99):02d}"
        if kind == 3:
            return f"{r.randint(1, 23)}:{r.randint(0, 59):02d}"
        return f"{r.randint(1, 99)}%"

    def _clause(self) -> str:
        r = self.r
        words = []
        for _ in range(r.randint(3, 9)):
            pick = r.random()
            if pick < 0.08:
                words.append(self._number())
            elif pick < 0.15:
                words.append(r.choice(self.names))
            else:
                words.append(r.choice(self.words))
        return " ".join(words)

    def sentence(self) -> str:
        r = self.r
        kind = r.randrange(10)
        if kind < 4:
            text, end = self._clause(), "."
        elif kind < 6:
            text, end = f"{self._clause()}, {self._clause()}", "."
        elif kind == 6:
            text, end = f"{self._clause()}; {self._clause()}", "."
        elif kind == 7:
            text, end = f"{self._clause()}: {self._clause()}", "!"
        elif kind == 8:
            text, end = self._clause(), "?"
        else:
            text, end = f'{r.choice(self.names)}: "{self._clause()}', '..."'
        return text[0].upper() + text[1:] + end


def coverage_lines(language: str) -> list[str]:
    """Lines holding every letter, digit and punctuation mark, each as a word of its own."""
    marks = " ".join(f"a{p}" for p in PUNCTUATION)
    return [" ".join(alphabet(language)), " ".join(DIGITS), marks] * 3


def sentences(seed: int, count: int, language: str = "english") -> Iterator[str]:
    """Yield `count` sentences in `language`, the same ones for the same seed, then the
    alphabet-coverage lines."""
    if language not in _EXTRA_LETTERS:
        raise ValueError(f"no corpus for language {language!r}: expected one of {LANGUAGES}")
    maker = _Maker(seed) if language == "english" else _WordsMaker(seed, language)
    for _ in range(count):
        yield maker.sentence()
    yield from coverage_lines(language)
