"""The language check's detector: which language a reply is written in, from the share of its words that are a
language's frequent function words. Pure functions of the reply text; part of the code that applies the checks
(``pipeline.suites.checks``), and versioned with it in the keys of the stages that apply them."""

from __future__ import annotations

import re

LANGUAGE_MIN_WORDS = 8        # language: fewer words than this have no language
LANGUAGE_MIN_SHARE = 0.15     # language: least share of function words of the detected language

_WORD = re.compile(r"[^\W\d_]+")               # a run of letters (any script)


# Frequent function words per language: a reply is in the language whose words make up the largest share of its
# words (at least LANGUAGE_MIN_SHARE of them, and more than any other language's share). No dependency, no model;
# enough to tell English, German, Spanish, French, Italian, Dutch and Portuguese prose apart, and to fail a reply
# that is mostly digits, symbols, code or another script. The other lists leave out words that are also common
# English words ("of", "is", "no", "as", ...), so English prose never ties with them.
_STOPWORDS = {
    "en": set("""the and to of a an in is are was were be been being for on that this these those with as at by from
        it its or but not no we you your our us i me my he she they them their his her will would can could should
        shall have has had do does did if then than there here which who whom what when where why how all any each
        please thank thanks so also into about after before up out over under per may must just only more most""".split()),
    "de": set("""der die das und ist nicht ein eine einen einem einer zu den dem des mit sich auf für von im sie wir
        ich es bitte auch als bei oder aber wie noch nach aus wird werden wurde wurden sind haben hat habe kann können
        uns unser unsere ihr ihre ihnen ihren dass vielen dank mein meine meinen sehr geehrte geehrter zum zur vom
        über bis wenn nur diese dieser dieses um gibt schon mir mich dir ihm""".split()),
    "es": set("""el la los las del y que en un una unos unas es son por para con su sus al lo como más pero se
        le les nos este esta estos estas ese esa muy ya hay fue ser está están gracias usted ustedes nuestro nuestra
        nuestros sobre también cuando donde si sí mi te hemos ha han puede pueden todo todos""".split()),
    "fr": set("""le la les des du et un une est sont que qui pour dans par sur avec ne pas plus au aux ce cette ces
        nous vous votre vos notre nos il elle ils elles je se son sa ses mais ou si très merci bonjour été être
        avoir ont avons avez sera leur leurs tout tous comme""".split()),
    "it": set("""il lo gli di del della dei delle e è un una uno che con non su da dal dalla al alla come più
        ma anche sono questo questa questi ci si ha hanno grazie nostro nostra vostro vostra suo sua siamo essere
        nel nella sul sulla ogni""".split()),
    "nl": set("""de het een en van dat die te op voor met niet zijn er aan ook als bij om maar door naar dan
        wij u uw ons onze ik je jullie wordt worden heeft hebben kan kunnen dit deze graag bedankt
        alstublieft nog wel geen""".split()),
    "pt": set("""o os da dos das e é um uma que em na nos nas para por com não se ao mais mas como seu sua
        você vocês nosso nossa foi ser está estão obrigado obrigada também muito pelo pela ou já são""".split()),
}


def language_shares(text: str) -> dict[str, float]:
    """Per language: the share of the text's words that are among its frequent function words."""
    words = [w.lower() for w in _WORD.findall(text)]
    if not words:
        return {lang: 0.0 for lang in _STOPWORDS}
    return {lang: sum(w in stop for w in words) / len(words) for lang, stop in _STOPWORDS.items()}


def detect_language(text: str) -> str | None:
    """The language code of a reply, or None when it has fewer than LANGUAGE_MIN_WORDS words, no language
    reaches LANGUAGE_MIN_SHARE, or two languages tie."""
    if len(_WORD.findall(text)) < LANGUAGE_MIN_WORDS:
        return None
    shares = sorted(language_shares(text).items(), key=lambda kv: kv[1], reverse=True)
    (best, top), (_, second) = shares[0], shares[1]
    if top < LANGUAGE_MIN_SHARE or top == second:
        return None
    return best
