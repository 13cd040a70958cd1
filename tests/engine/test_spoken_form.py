# ruff: noqa: E501  (the table keeps one case per line, however long the spoken form)
"""Spoken-form text: a table of cases per language, and the properties every input keeps."""

from __future__ import annotations

import pytest

from intone.engine.errors import InvalidOptionError
from intone.engine.loading import LoadedModel
from intone.engine.options import GenerationOptions
from intone.engine.spoken_form import LANGUAGES
from intone.engine.text import normalize_text, plan_clause, prepare_text

CASES: dict[str, list[tuple[str, str]]] = {
    "en": [
        ('It costs $12.50 today.', 'It costs twelve dollars and fifty cents today.'),
        ('That is $1 only.', 'That is one dollar only.'),
        ('Just $0.99.', 'Just ninety-nine cents.'),
        ('A $1.5 million deal.', 'A one point five million dollars deal.'),
        ('It was €5.', 'It was five euros.'),
        ('Pay £3.20 now.', 'Pay three pounds and twenty pence now.'),
        ('Meet at 3:45 pm.', 'Meet at three forty-five p m.'),
        ('Meet at 3:05 a.m. tomorrow', 'Meet at three oh five a m tomorrow'),
        ('At 15:30 sharp.', 'At fifteen thirty sharp.'),
        ('Call at 9am.', 'Call at nine a m.'),
        ('At 7:00 pm.', 'At seven p m.'),
        ('Dr. Smith is here.', 'Doctor Smith is here.'),
        ('Mr. and Mrs. Jones.', 'Mister and Missus Jones.'),
        ('Apples, pears, etc. are fruit.', 'Apples, pears, et cetera are fruit.'),
        ('Fruit, e.g. apples.', 'Fruit, for example apples.'),
        ('Call 555-0123.', 'Call five five five, zero one two three.'),
        ('Call +1 (415) 555-2671 now.', 'Call plus one, four one five, five five five, two six seven one now.'),
        ('Dial 800.555.1234 today.', 'Dial eight zero zero, five five five, one two three four today.'),
        ('Growth was 25%.', 'Growth was twenty-five percent.'),
        ('Down 3.5% today.', 'Down three point five percent today.'),
        ('She came 1st.', 'She came first.'),
        ('The 2nd and 3rd place.', 'The second and third place.'),
        ('The 21st century.', 'The twenty-first century.'),
        ('On 2026-11-30 we ship.', 'On November thirtieth, twenty twenty-six we ship.'),
        ('On 11/30/2026 we ship.', 'On November thirtieth, twenty twenty-six we ship.'),
        ('November 30, 2026.', 'November thirtieth, twenty twenty-six.'),
        ('On 3 March 2025.', 'On March third, twenty twenty-five.'),
        ('In May 2026.', 'In May twenty twenty-six.'),
        ('The 1990s were fun.', 'The nineteen nineties were fun.'),
        ('In 1999 we met.', 'In nineteen ninety-nine we met.'),
        ('There were 1,234,567 people.', 'There were one million two hundred and thirty-four thousand five hundred and sixty-seven people.'),
        ('Pi is 3.14159.', 'Pi is three point one four one five nine.'),
        ('It is 42.', 'It is forty-two.'),
        ('Visit https://example.com/docs today.', 'Visit example dot com slash docs today.'),
        ('Mail bob.smith@gmail.com now.', 'Mail bob dot smith at gmail dot com now.'),
        ('See www.intone.ai.', 'See w w w dot intone dot ai.'),
        ('**Bold** and _italic_ text.', 'Bold and italic text.'),
        ('# Heading', 'Heading'),
        ('- a list item', 'a list item'),
        ('Great job 🎉👍!', 'Great job!'),
        ('Use `pip install` here.', 'Use pip install here.'),
        ('Read [the docs](https://x.io) now.', 'Read the docs now.'),
        ('I ran 5 km in 30 min.', 'I ran five kilometers in thirty minutes.'),
        ('It weighs 1 kg.', 'It weighs one kilogram.'),
        ('It is -5°C outside.', 'It is minus five degrees Celsius outside.'),
        ('221B Baker St. London', 'two hundred and twenty-one B Baker Street London'),
        ('Room No. 5.', 'Room number five.'),
        ('From 10-20 people.', 'From ten to twenty people.'),
        ('Tom & Jerry.', 'Tom and Jerry.'),
        ('1 + 2 = 3', 'one plus two equals three'),
        ('Agent 007.', 'Agent zero zero seven.'),
        ('No digits here.', 'No digits here.'),
    ],
    "fr": [
        ('Ça coûte 12,50 €.', 'Ça coûte douze euros et cinquante centimes.'),
        ('Seulement 1 €.', 'Seulement un euro.'),
        ('Un prix de 5 $.', 'Un prix de cinq dollars.'),
        ('Il est 15h30.', 'Il est quinze heures trente.'),
        ('Rendez-vous à 15:30.', 'Rendez-vous à quinze heures trente.'),
        ('À 1:00 du matin.', 'À une heure du matin.'),
        ('À 20h.', 'À vingt heures.'),
        ('Le Dr Martin et M. Dupont.', 'Le Docteur Martin et Monsieur Dupont.'),
        ('Mme Durand, Mlle Petit.', 'Madame Durand, Mademoiselle Petit.'),
        ('Des fruits, etc.', 'Des fruits, et cetera.'),
        ('Appelez le 06 12 34 56 78.', 'Appelez le zéro six, un deux, trois quatre, cinq six, sept huit.'),
        ('Appelez le +33 1 23 45 67 89.', 'Appelez le plus trois trois, un, deux trois, quatre cinq, six sept, huit neuf.'),
        ('Une hausse de 25 %.', 'Une hausse de vingt-cinq pour cent.'),
        ('Une baisse de 3,5 %.', 'Une baisse de trois virgule cinq pour cent.'),
        ('Le 1er mai 2026.', 'Le premier mai deux mille vingt-six.'),
        ('Le 2026-11-30.', 'Le trente novembre deux mille vingt-six.'),
        ('Le 30/11/2026.', 'Le trente novembre deux mille vingt-six.'),
        ('En mai 2026.', 'En mai deux mille vingt-six.'),
        ('La 2e place.', 'La deuxième place.'),
        ('La 1re fois.', 'La première fois.'),
        ('Le 21e siècle.', 'Le vingt et unième siècle.'),
        ('Il y a 1 234 567 habitants.', 'Il y a un million deux cent trente-quatre mille cinq cent soixante-sept habitants.'),
        ('Il y a 1.234.567 habitants.', 'Il y a un million deux cent trente-quatre mille cinq cent soixante-sept habitants.'),
        ('Pi vaut 3,14.', 'Pi vaut trois virgule un quatre.'),
        ('Il a 42 ans.', 'Il a quarante-deux ans.'),
        ('Il fait -5 °C.', 'Il fait moins cinq degrés Celsius.'),
        ('Il a couru 10 km en 45 min.', 'Il a couru dix kilomètres en quarante-cinq minutes.'),
        ('Ça pèse 1 kg.', 'Ça pèse un kilo.'),
        ('Visitez www.exemple.fr.', 'Visitez w w w point exemple point fr.'),
        ('Écrivez à jean@exemple.fr.', 'Écrivez à jean arobase exemple point fr.'),
        ('Voir https://exemple.fr/aide.', 'Voir exemple point fr slash aide.'),
        ('**Gras** et _italique_.', 'Gras et italique.'),
        ('# Titre', 'Titre'),
        ('- un élément', 'un élément'),
        ('Bravo 🎉 !', 'Bravo!'),
        ('Lisez [la doc](https://x.io).', 'Lisez la doc.'),
        ('De 10-20 personnes.', 'De dix à vingt personnes.'),
        ('Tom & Jerry.', 'Tom et Jerry.'),
        ('1 + 2 = 3', 'un plus deux égale trois'),
        ('n° 5', 'numéro cinq'),
        ('Pas de chiffres ici.', 'Pas de chiffres ici.'),
        ('Un fichier de 2 Go.', 'Un fichier de deux gigaoctets.'),
    ],
    "de": [
        ('Das kostet 12,50 €.', 'Das kostet zwölf Euro und fünfzig Cent.'),
        ('Nur 1 €.', 'Nur ein Euro.'),
        ('Das kostet 5 $.', 'Das kostet fünf Dollar.'),
        ('Um 15:30 Uhr.', 'Um fünfzehn Uhr dreißig.'),
        ('Um 15.30 Uhr.', 'Um fünfzehn Uhr dreißig.'),
        ('Um 1:00 Uhr.', 'Um ein Uhr.'),
        ('Um 20:05.', 'Um zwanzig Uhr fünf.'),
        ('Dr. Müller und Hr. Schmidt.', 'Doktor Müller und Herr Schmidt.'),
        ('Fr. Weber kommt.', 'Frau Weber kommt.'),
        ('Obst, z.B. Äpfel.', 'Obst, zum Beispiel Äpfel.'),
        ('Äpfel usw.', 'Äpfel und so weiter.'),
        ('Rufen Sie 030 1234567 an.', 'Rufen Sie null drei null, eins zwei drei vier fünf sechs sieben an.'),
        ('Rufen Sie +49 30 12345678 an.', 'Rufen Sie plus vier neun, drei null, eins zwei drei vier fünf sechs sieben acht an.'),
        ('Ein Plus von 25 %.', 'Ein Plus von fünfundzwanzig Prozent.'),
        ('Ein Minus von 3,5 %.', 'Ein Minus von drei Komma fünf Prozent.'),
        ('Am 3. Mai 2026.', 'Am dritten Mai zweitausendsechsundzwanzig.'),
        ('Der 3. Mai ist frei.', 'Der dritte Mai ist frei.'),
        ('Am 30.11.2026 ist es.', 'Am dreißigsten November zweitausendsechsundzwanzig ist es.'),
        ('Das war 2026-11-30.', 'Das war dreißigster November zweitausendsechsundzwanzig.'),
        ('Im Mai 2026.', 'Im Mai zweitausendsechsundzwanzig.'),
        ('Der 3. Platz.', 'Der dritte Platz.'),
        ('Es gibt 1.234.567 Einwohner.', 'Es gibt eine Million zweihundertvierunddreißigtausendfünfhundertsiebenundsechzig Einwohner.'),
        ('Pi ist 3,14.', 'Pi ist drei Komma eins vier.'),
        ('Er ist 42.', 'Er ist zweiundvierzig.'),
        ('Es sind -5 °C.', 'Es sind minus fünf Grad Celsius.'),
        ('Wir fahren 100 km/h.', 'Wir fahren einhundert Kilometer pro Stunde.'),
        ('Es wiegt 1 kg.', 'Es wiegt ein Kilogramm.'),
        ('Er lief 10 km in 45 min.', 'Er lief zehn Kilometer in fünfundvierzig Minuten.'),
        ('Nr. 5', 'Nummer fünf'),
        ('Besuchen Sie www.beispiel.de.', 'Besuchen Sie w w w Punkt beispiel Punkt de.'),
        ('Schreiben Sie an max@beispiel.de.', 'Schreiben Sie an max at beispiel Punkt de.'),
        ('Siehe https://beispiel.de/hilfe.', 'Siehe beispiel Punkt de Schrägstrich hilfe.'),
        ('**Fett** und _kursiv_.', 'Fett und kursiv.'),
        ('# Titel', 'Titel'),
        ('- ein Punkt', 'ein Punkt'),
        ('Super 🎉!', 'Super!'),
        ('Lies [die Doku](https://x.io).', 'Lies die Doku.'),
        ('Von 10-20 Leuten.', 'Von zehn bis zwanzig Leuten.'),
        ('Tom & Jerry.', 'Tom und Jerry.'),
        ('1 + 2 = 3', 'eins plus zwei gleich drei'),
        ('Keine Ziffern hier.', 'Keine Ziffern hier.'),
        ('Eine Datei mit 2 GB.', 'Eine Datei mit zwei Gigabyte.'),
    ],
    "es": [
        ('Cuesta 12,50 €.', 'Cuesta doce euros con cincuenta céntimos.'),
        ('Solo 1 €.', 'Solo un euro.'),
        ('Cuesta $3.', 'Cuesta tres dólares.'),
        ('A las 15:30.', 'A las quince y treinta.'),
        ('A la 1:00.', 'A la una en punto.'),
        ('A las 20:00.', 'A las veinte en punto.'),
        ('El Sr. García y la Sra. López.', 'El señor García y la señora López.'),
        ('El Dr. Pérez.', 'El doctor Pérez.'),
        ('Frutas, p. ej. manzanas.', 'Frutas, por ejemplo manzanas.'),
        ('Frutas, etc.', 'Frutas, etcétera.'),
        ('Llame al 612 34 56 78.', 'Llame al seis uno dos, tres cuatro, cinco seis, siete ocho.'),
        ('Llame al +34 912 345 678.', 'Llame al más tres cuatro, nueve uno dos, tres cuatro cinco, seis siete ocho.'),
        ('Un 25 % más.', 'Un veinticinco por ciento más.'),
        ('Un 3,5 % menos.', 'Un tres coma cinco por ciento menos.'),
        ('El 1º y la 2ª.', 'El primero y la segunda.'),
        ('El 2026-11-30.', 'El treinta de noviembre de dos mil veintiséis.'),
        ('El 30/11/2026.', 'El treinta de noviembre de dos mil veintiséis.'),
        ('El 3 de mayo de 2026.', 'El tres de mayo de dos mil veintiséis.'),
        ('En mayo de 2026.', 'En mayo de dos mil veintiséis.'),
        ('Hay 1.234.567 habitantes.', 'Hay un millón doscientos treinta y cuatro mil quinientos sesenta y siete habitantes.'),
        ('Pi es 3,14.', 'Pi es tres coma uno cuatro.'),
        ('Tiene 42 años.', 'Tiene cuarenta y dos años.'),
        ('Hace -5 °C.', 'Hace menos cinco grados Celsius.'),
        ('Corrió 10 km en 45 min.', 'Corrió diez kilómetros en cuarenta y cinco minutos.'),
        ('Pesa 1 kg.', 'Pesa un kilo.'),
        ('Va a 100 km/h.', 'Va a cien kilómetros por hora.'),
        ('Visite www.ejemplo.es.', 'Visite w w w punto ejemplo punto es.'),
        ('Escriba a info@ejemplo.es.', 'Escriba a info arroba ejemplo punto es.'),
        ('Vea https://ejemplo.es/ayuda.', 'Vea ejemplo punto es barra ayuda.'),
        ('**Negrita** y _cursiva_.', 'Negrita y cursiva.'),
        ('# Título', 'Título'),
        ('- un elemento', 'un elemento'),
        ('¡Genial 🎉!', '¡Genial!'),
        ('Lea [la guía](https://x.io).', 'Lea la guía.'),
        ('De 10-20 personas.', 'De diez a veinte personas.'),
        ('Tom & Jerry.', 'Tom y Jerry.'),
        ('1 + 2 = 3', 'uno más dos igual a tres'),
        ('Sin cifras aquí.', 'Sin cifras aquí.'),
        ('Un archivo de 2 GB.', 'Un archivo de dos gigabytes.'),
        ('Es el 21º.', 'Es el vigésimo primero.'),
        ('Aprox. 5 metros.', 'aproximadamente cinco metros.'),
    ],
    "it": [
        ('Costa 12,50 €.', 'Costa dodici euro e cinquanta centesimi.'),
        ('Solo 1 €.', 'Solo un euro.'),
        ('Costa $3.', 'Costa tre dollari.'),
        ('Alle 15:30.', 'Alle quindici e trenta.'),
        ("All'1:00.", "All'una in punto."),
        ('Alle 20:00.', 'Alle venti in punto.'),
        ('Il Sig. Rossi e la Sig.ra Bianchi.', 'Il signor Rossi e la signora Bianchi.'),
        ('Il Dott. Verdi.', 'Il dottor Verdi.'),
        ('Frutta, ecc.', 'Frutta, eccetera.'),
        ('Il Prof. Neri.', 'Il professor Neri.'),
        ('Chiami il 333 123 4567.', 'Chiami il tre tre tre, uno due tre, quattro cinque sei sette.'),
        ('Chiami il +39 06 1234 5678.', 'Chiami il più tre nove, zero sei, uno due tre quattro, cinque sei sette otto.'),
        ('Un aumento del 25 %.', 'Un aumento del venticinque per cento.'),
        ('Un calo del 3,5%.', 'Un calo del tre virgola cinque per cento.'),
        ('Il 1º e la 2ª.', 'Il primo e la seconda.'),
        ('Il 2026-11-30.', 'Il trenta novembre duemilaventisei.'),
        ('Il 30/11/2026.', 'Il trenta novembre duemilaventisei.'),
        ('Il 3 maggio 2026.', 'Il tre maggio duemilaventisei.'),
        ('A maggio 2026.', 'A maggio duemilaventisei.'),
        ('Ci sono 1.234.567 abitanti.', 'Ci sono un milione e duecentotrentaquattromilacinquecentosessantasette abitanti.'),
        ('Pi è 3,14.', 'Pi è tre virgola uno quattro.'),
        ('Ha 42 anni.', 'Ha quarantadue anni.'),
        ('Fa -5 °C.', 'Fa meno cinque gradi Celsius.'),
        ('Ha corso 10 km in 45 min.', 'Ha corso dieci chilometri in quarantacinque minuti.'),
        ('Pesa 1 kg.', 'Pesa un chilo.'),
        ('Va a 100 km/h.', 'Va a cento chilometri orari.'),
        ('Visiti www.esempio.it.', 'Visiti w w w punto esempio punto it.'),
        ('Scriva a info@esempio.it.', 'Scriva a info chiocciola esempio punto it.'),
        ('Veda https://esempio.it/aiuto.', 'Veda esempio punto it barra aiuto.'),
        ('**Grassetto** e _corsivo_.', 'Grassetto e corsivo.'),
        ('# Titolo', 'Titolo'),
        ('- un elemento', 'un elemento'),
        ('Bravo 🎉!', 'Bravo!'),
        ('Legga [la guida](https://x.io).', 'Legga la guida.'),
        ('Da 10-20 persone.', 'Da dieci a venti persone.'),
        ('Tom & Jerry.', 'Tom e Jerry.'),
        ('1 + 2 = 3', 'uno più due uguale a tre'),
        ('Nessuna cifra qui.', 'Nessuna cifra qui.'),
        ('Un file di 2 GB.', 'Un file di due gigabyte.'),
        ('Il n. 5', 'Il numero cinque'),
        ('Il 21º secolo.', 'Il ventunesimo secolo.'),
    ],
    "pt": [
        ('Custa 12,50 €.', 'Custa doze euros e cinquenta cêntimos.'),
        ('Só 1 €.', 'Só um euro.'),
        ('Custa R$ 3,20.', 'Custa três reais e vinte centavos.'),
        ('Às 15:30.', 'Às quinze e trinta.'),
        ('À 1:00.', 'À uma hora.'),
        ('Às 20:00.', 'Às vinte horas.'),
        ('O Sr. Silva e a Sra. Costa.', 'O senhor Silva e a senhora Costa.'),
        ('O Dr. Santos.', 'O doutor Santos.'),
        ('Frutas, etc.', 'Frutas, etcétera.'),
        ('Frutas, p. ex. maçãs.', 'Frutas, por exemplo maçãs.'),
        ('Ligue para 912 345 678.', 'Ligue para nove um dois, três quatro cinco, seis sete oito.'),
        ('Ligue para +351 21 123 4567.', 'Ligue para mais três cinco um, dois um, um dois três, quatro cinco seis sete.'),
        ('Um aumento de 25 %.', 'Um aumento de vinte e cinco por cento.'),
        ('Uma queda de 3,5%.', 'Uma queda de três vírgula cinco por cento.'),
        ('O 1º e a 2ª.', 'O primeiro e a segunda.'),
        ('Em 2026-11-30.', 'Em trinta de novembro de dois mil e vinte e seis.'),
        ('Em 30/11/2026.', 'Em trinta de novembro de dois mil e vinte e seis.'),
        ('Em 3 de maio de 2026.', 'Em três de maio de dois mil e vinte e seis.'),
        ('Em maio de 2026.', 'Em maio de dois mil e vinte e seis.'),
        ('Há 1.234.567 habitantes.', 'Há um milhão duzentos e trinta e quatro mil quinhentos e sessenta e sete habitantes.'),
        ('Pi é 3,14.', 'Pi é três vírgula um quatro.'),
        ('Tem 42 anos.', 'Tem quarenta e dois anos.'),
        ('Faz -5 °C.', 'Faz menos cinco graus Celsius.'),
        ('Correu 10 km em 45 min.', 'Correu dez quilómetros em quarenta e cinco minutos.'),
        ('Pesa 1 kg.', 'Pesa um quilo.'),
        ('Vai a 100 km/h.', 'Vai a cem quilómetros por hora.'),
        ('Visite www.exemplo.pt.', 'Visite w w w ponto exemplo ponto pt.'),
        ('Escreva para info@exemplo.pt.', 'Escreva para info arroba exemplo ponto pt.'),
        ('Veja https://exemplo.pt/ajuda.', 'Veja exemplo ponto pt barra ajuda.'),
        ('**Negrito** e _itálico_.', 'Negrito e itálico.'),
        ('# Título', 'Título'),
        ('- um item', 'um item'),
        ('Ótimo 🎉!', 'Ótimo!'),
        ('Leia [o guia](https://x.io).', 'Leia o guia.'),
        ('De 10-20 pessoas.', 'De dez a vinte pessoas.'),
        ('Tom & Jerry.', 'Tom e Jerry.'),
        ('1 + 2 = 3', 'um mais dois igual a três'),
        ('Sem algarismos aqui.', 'Sem algarismos aqui.'),
        ('Um ficheiro de 2 GB.', 'Um ficheiro de dois gigabytes.'),
        ('A nº 5', 'A número cinco'),
        ('O 21º século.', 'O vigésimo primeiro século.'),
    ],
    "nl": [
        ('Het kost 12,50 €.', 'Het kost twaalf euro en vijftig cent.'),
        ('Maar 1 €.', 'Maar één euro.'),
        ('Het kost $3.', 'Het kost drie dollar.'),
        ('Om 15:30 uur.', 'Om vijftien uur dertig.'),
        ('Om 15.30 uur.', 'Om vijftien uur dertig.'),
        ('Om 1:00.', 'Om één uur.'),
        ('Om 20:05.', 'Om twintig uur vijf.'),
        ('Dhr. Jansen en mevr. de Vries.', 'de heer Jansen en mevrouw de Vries.'),
        ('Dr. Bakker.', 'dokter Bakker.'),
        ('Fruit, bijv. appels.', 'Fruit, bijvoorbeeld appels.'),
        ('Appels enz.', 'Appels enzovoort.'),
        ('Bel 06 12345678.', 'Bel nul zes, één twee drie vier vijf zes zeven acht.'),
        ('Bel +31 20 123 4567.', 'Bel plus drie één, twee nul, één twee drie, vier vijf zes zeven.'),
        ('Een stijging van 25 %.', 'Een stijging van vijfentwintig procent.'),
        ('Een daling van 3,5%.', 'Een daling van drie komma vijf procent.'),
        ('De 1e en de 2de.', 'De eerste en de tweede.'),
        ('Op 2026-11-30.', 'Op dertig november tweeduizendzesentwintig.'),
        ('Op 30-11-2026.', 'Op dertig november tweeduizendzesentwintig.'),
        ('Op 3 mei 2026.', 'Op drie mei tweeduizendzesentwintig.'),
        ('In mei 2026.', 'In mei tweeduizendzesentwintig.'),
        ('Er zijn 1.234.567 inwoners.', 'Er zijn een miljoen tweehonderdvierendertigduizendvijfhonderdzevenenzestig inwoners.'),
        ('Pi is 3,14.', 'Pi is drie komma één vier.'),
        ('Hij is 42.', 'Hij is tweeënveertig.'),
        ('Het is -5 °C.', 'Het is min vijf graden Celsius.'),
        ('Hij liep 10 km in 45 min.', 'Hij liep tien kilometer in vijfenveertig minuten.'),
        ('Het weegt 1 kg.', 'Het weegt één kilo.'),
        ('Hij rijdt 100 km/u.', 'Hij rijdt honderd kilometer per uur.'),
        ('Bezoek www.voorbeeld.nl.', 'Bezoek w w w punt voorbeeld punt nl.'),
        ('Mail naar info@voorbeeld.nl.', 'Mail naar info apenstaartje voorbeeld punt nl.'),
        ('Zie https://voorbeeld.nl/hulp.', 'Zie voorbeeld punt nl slash hulp.'),
        ('**Vet** en _cursief_.', 'Vet en cursief.'),
        ('# Titel', 'Titel'),
        ('- een punt', 'een punt'),
        ('Top 🎉!', 'Top!'),
        ('Lees [de gids](https://x.io).', 'Lees de gids.'),
        ('Van 10-20 mensen.', 'Van tien tot twintig mensen.'),
        ('Tom & Jerry.', 'Tom en Jerry.'),
        ('1 + 2 = 3', 'één plus twee is gelijk aan drie'),
        ('Geen cijfers hier.', 'Geen cijfers hier.'),
        ('Een bestand van 2 GB.', 'Een bestand van twee gigabyte.'),
        ('nr. 5', 'nummer vijf'),
        ('De 8ste keer.', 'De achtste keer.'),
    ],
}  # fmt: skip


@pytest.mark.parametrize("language", LANGUAGES)
def test_table_has_forty_cases_per_language(language: str) -> None:
    assert len(CASES[language]) >= 40


@pytest.mark.parametrize(
    ("language", "text", "spoken"),
    [(language, text, spoken) for language, cases in CASES.items() for text, spoken in cases],
)
def test_spoken_form(language: str, text: str, spoken: str) -> None:
    assert normalize_text(text, language) == spoken


@pytest.mark.parametrize("language", LANGUAGES)
def test_no_digits_symbols_or_emoji_survive(language: str) -> None:
    for text, _ in CASES[language]:
        spoken = normalize_text(text, language)
        assert not any(c.isdigit() for c in spoken), (text, spoken)
        assert not set(spoken) & set("$€£¥%@*#`🎉👍"), (text, spoken)


def test_plain_text_is_unchanged() -> None:
    text = "Hello there, how are you doing today? Fine, thanks."
    assert normalize_text(text) == text


def test_default_language_is_english() -> None:
    assert normalize_text("It is 42.") == "It is forty-two."


def test_region_tags_are_accepted() -> None:
    assert normalize_text("25%", "pt-BR") == normalize_text("25%", "pt")


def test_unknown_language_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown language"):
        normalize_text("42", "xx")


def test_normalize_option_takes_booleans_only() -> None:
    assert GenerationOptions().normalize is True
    assert GenerationOptions(normalize=False).normalize is False
    for bad in (1, "yes", None):
        with pytest.raises(InvalidOptionError, match="normalize"):
            GenerationOptions(normalize=bad)


def test_clause_plan_reads_the_spoken_form(tiny_model: LoadedModel) -> None:
    clause = "It costs $1,234.56 at 3:45 pm."
    spoken = normalize_text(clause, tiny_model.language)
    on = plan_clause(tiny_model, clause, GenerationOptions())
    off = plan_clause(tiny_model, clause, GenerationOptions(normalize=False))
    assert on.tokens == tiny_model.tokenizer.encode(
        prepare_text(spoken, tiny_model.text_options)[0]
    )
    assert off.tokens == tiny_model.tokenizer.encode(
        prepare_text(clause, tiny_model.text_options)[0]
    )
    # The frame budget follows the spoken form, which is much longer than the written one.
    assert on.max_frames > off.max_frames
