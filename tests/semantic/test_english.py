"""Which texts read as English: the rest gets no semantic view, whatever its script."""

from __future__ import annotations

import json

import orjson
import pytest

from carpool.config import Config
from carpool.fingerprint import fingerprint, semantic_view
from carpool.request import ClientRequest, parse
from carpool.semantic.english import reads_english

#: Traps of a reviewer's (10 languages, Latin script): each pair's two sides differ in meaning
#: while every letter is Latin and every word is known to the verifier's WordPiece.
TRAPS = {
    "de": (
        "Soll ich Antibiotika mit Milch einnehmen?",
        "Soll ich Antibiotika nicht mit Milch einnehmen?",
    ),
    "pt": (
        "Escreva um e-mail dizendo que aceito a proposta.",
        "Escreva um e-mail dizendo que não aceito a proposta.",
    ),
    "fr": ("Comment activer le Bluetooth", "Comment désactiver le Bluetooth"),
    "tr": ("Hisse senedi nasıl alınır?", "Hisse senedi nasıl satılır?"),
    "es": ("¿Qué significa papá?", "¿Qué significa papa?"),
    "it": ("Come posso aprire un conto in banca?", "Come posso chiudere un conto in banca?"),
    "nl": ("Wat is de hoofdstad van Denemarken?", "Wat is de hoofdstad van Noorwegen?"),
    "pl": ("Jak włączyć tryb samolotowy?", "Jak wyłączyć tryb samolotowy?"),
    "id": ("Berapa 16 dikali 3?", "Berapa 16 dikali 5?"),
    "vi": ("Làm thế nào để bật Bluetooth?", "Làm thế nào để tắt Bluetooth?"),
    # An English question about a German sign: "an" is English, "aus" was no foreign word, and
    # "Licht an" / "Licht aus" (on / off) were served each other's answers (27 of 54).
    "de-in-en": (
        "My neighbour put a sign on her door that says Licht aus in her own language, what does"
        " it say?",
        "What does the switch label Heizung zu mean in English?",
    ),
    # English around a German comment: its other side ("# löschen") may read as English, this
    # one never does, so the pair is never compared.
    "mixed": ("Fix my code:\nx = load()  # nicht löschen\nsave(x)",),
}

#: English that must still be compared by meaning: short, questions, orders, code, names,
#: numbers, slang.
ENGLISH = [
    "How do I reset my password?",
    "Reset password",
    "Thanks!",
    "Yo, dog, something's wrong.",
    "Write a haiku about autumn in Kyoto.",
    "Convert 30 degrees Celsius to Fahrenheit.",
    "Did Bill Gates outcompete and outsmart IBM? Why? How?",
    "Japanese: Do westerners smell bad?",
    "How will banning Rs. 500 and Rs. 1000 notes help in overcoming corruption in India?",
    "Why does `df.groupby('x').agg(np.mean)` raise a KeyError?",
    "Fix this:\n```python\ndef f(x):\n    return x_max / 0\n```\nIt crashes.",
    "What's the difference between PostgreSQL and MySQL?",
    "I'm 24 and I don't know what to do with my life.",
    "Is ibuprofen safe to take with alcohol?",
    "Explain van der Waals forces.",
    "Flights to AUS from Denver?",
]


def view_of(text: str, **semantic):
    config = Config.model_validate({"semantic": semantic})
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}
    request = parse(ClientRequest("/v1/chat/completions", orjson.dumps(body), {}), 1 << 20)
    return semantic_view(request, fingerprint(request, config), config)


@pytest.mark.parametrize("language", sorted(TRAPS))
def test_a_trap_that_does_not_read_as_english_has_no_semantic_view(language):
    for text in TRAPS[language]:
        assert not reads_english(text), text
        assert view_of(text) is None, text
        assert view_of(text, scripts=["*"]) is None, text  # whatever the embedder reads


@pytest.mark.parametrize("text", ENGLISH)
def test_english_reads_as_english_and_keeps_its_semantic_view(text):
    assert reads_english(text), text
    assert view_of(text) is not None


def test_an_earlier_turn_that_does_not_read_as_english_leaves_no_semantic_view():
    config = Config()
    history = [
        {"role": "user", "content": "Soll ich Antibiotika nicht mit Milch einnehmen?"},
        {"role": "assistant", "content": "Ja."},
    ]
    body = {
        "model": "m",
        "temperature": 0,
        "messages": [*history, {"role": "user", "content": "Why is that?"}],
    }
    request = parse(ClientRequest("/v1/chat/completions", orjson.dumps(body), {}), 1 << 20)
    assert semantic_view(request, fingerprint(request, config), config) is None


#: A sentence of English prose, repeated past ``semantic.max_text_chars`` (16,384 by default).
PROSE = "The quarterly report shows that revenue grew while the costs stayed flat. "


def test_a_text_or_earlier_turns_longer_than_max_text_chars_have_no_semantic_view():
    # The gate reads every character on the event loop (~1 µs each: 8 MB took 7 s, every other
    # request of the process waiting): a longer text is matched exactly, unread.
    within, past = PROSE * (16_384 // len(PROSE)), PROSE * (16_384 // len(PROSE) + 1)
    assert len(within) <= 16_384 < len(past)
    assert view_of(within) is not None
    assert view_of(past) is None
    assert view_of(PROSE, max_text_chars=len(PROSE)) is not None
    assert view_of(PROSE + "Why?", max_text_chars=len(PROSE)) is None
    # An English head is no pass for what follows it: the whole text is bounded, never a prefix.
    assert view_of(within + "Soll ich Antibiotika nicht mit Milch einnehmen?") is None
    config = Config()
    body = {
        "model": "m",
        "temperature": 0,
        "messages": [
            {"role": "user", "content": past},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Why is that?"},
        ],
    }
    request = parse(ClientRequest("/v1/chat/completions", orjson.dumps(body), {}), 1 << 20)
    assert semantic_view(request, fingerprint(request, config), config) is None


def test_english_only_off_compares_any_text_of_the_scripts_by_meaning():
    # The operator's choice, with a guard of their own: the scripts still hold.
    assert view_of(TRAPS["de"][0], english_only=False) is not None
    assert view_of("如何删除我的账户", english_only=False) is None


@pytest.mark.parametrize(
    "text",
    [
        "Как не сбросить мой роутер?",
        "Πώς να μην επαναφέρω τον δρομολογητή;",
        "ルーターをリセットしない方法",
    ],
)
def test_the_packaged_verifier_compares_no_script_it_cannot_read_whatever_scripts_says(text):
    # It splits Cyrillic, Greek and kana into pieces it has (no unknown token to score 0), and
    # scored their negations the same, 0.988-0.996: served with `scripts: ["*"]`.
    from carpool.semantic.verifier import PACKAGED

    assert view_of(text, english_only=False, scripts=["*"]) is None
    # Named as a folder of one's own, the packaged verifier is still the same model.
    assert view_of(text, english_only=False, scripts=["*"], verifier_dir=str(PACKAGED)) is None


def test_a_verifier_reads_the_scripts_its_folder_names(tmp_path):
    # (A verifier of the operator's own, trained on other languages, says so in verifier.json.)
    from carpool.semantic.verifier import PACKAGED

    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes((PACKAGED / name).read_bytes())
    meta = json.loads((PACKAGED / "verifier.json").read_text())
    (tmp_path / "verifier.json").write_text(json.dumps({**meta, "scripts": ["Latin", "Cyrillic"]}))
    text = "Как не сбросить мой роутер?"
    own = {"english_only": False, "verifier_dir": str(tmp_path)}
    assert view_of(text, scripts=["*"], **own) is not None
    assert view_of(text, scripts=["Latin"], **own) is None  # (and what `scripts` lets through)


@pytest.mark.parametrize("collapse", [False, True])
def test_an_earlier_turn_holding_a_character_the_models_drop_has_no_semantic_view(collapse):
    # Each turn normalised before the turns were joined, a collapse turned a vertical tab or a
    # C1 control into a space before the check read the context: a view, where the last turn
    # with the same character got none.
    config = Config.model_validate(
        {"fingerprint": {"normalize_whitespace": collapse}, "semantic": {}}
    )
    messages = [
        {"role": "user", "content": "Is the pharmacy open?\x0bIt is late."},
        {"role": "assistant", "content": "It is open."},
        {"role": "user", "content": "How do I get there?"},
    ]
    body = {"model": "m", "temperature": 0, "messages": messages}
    request = parse(ClientRequest("/v1/chat/completions", orjson.dumps(body), {}), 1 << 20)
    assert semantic_view(request, fingerprint(request, config), config) is None


@pytest.mark.parametrize("named", ["Cyrillic", [], ["Latin", 5], "{not json"])
def test_a_verifier_folder_naming_its_scripts_wrongly_is_refused_at_load(tmp_path, named):
    # Read as Latin, silently: a Cyrillic verifier's texts were exact-only, nothing said why.
    from carpool.semantic.verifier import PACKAGED

    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes((PACKAGED / name).read_bytes())
    meta = json.loads((PACKAGED / "verifier.json").read_text())
    written = named if named == "{not json" else json.dumps({**meta, "scripts": named})
    # (Validated once with a good one first: what was read then is not taken for it now.)
    (tmp_path / "verifier.json").write_text(json.dumps(meta))
    Config.model_validate({"semantic": {"verifier_dir": str(tmp_path)}})
    (tmp_path / "verifier.json").write_text(written)
    with pytest.raises(ValueError, match="verifier.json"):
        Config.model_validate({"semantic": {"verifier_dir": str(tmp_path)}})
    # (Edited after the config loaded: read as Latin, never a failed request.)
    from carpool.semantic.view import read_scripts, verifier_scripts

    loaded = Config.model_construct(
        semantic=Config().semantic.model_copy(update={"verifier_dir": str(tmp_path)})
    )
    verifier_scripts.cache_clear()
    assert read_scripts(loaded) == ["Latin"]


def test_other_scripts_never_read_as_english():
    for text in ("如何删除我的账户", "Привет, как дела?", "What does それでもまだ mean?"):
        assert not reads_english(text), text
    assert reads_english("What is the area of a circle of radius 2π?")  # a symbol, no word


def test_a_decomposed_text_reads_as_its_composed_form():
    import unicodedata

    for text in [*ENGLISH, *(t for pair in TRAPS.values() for t in pair)]:
        assert reads_english(unicodedata.normalize("NFD", text)) == reads_english(text)


def test_the_vocabulary_is_the_packaged_verifiers():
    from carpool.semantic.english import vocabulary
    from carpool.semantic.verifier import PACKAGED

    vocab = json.loads((PACKAGED / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocabulary() == {w for w in vocab if w.isalpha()} and "password" in vocabulary()


#: Non-English a reviewer cut into lines, sentences or comments too short to be read alone; each
#: was served the other side's answer end to end.
SHORT_PIECES = {
    "de": "Antibiotika. Ohne Milch. Einnehmen?",
    "es": "Tomar ibuprofeno. Sin alcohol. Es seguro?",
    "de lines": "Betreff: Verlängerung\nKundennummer: 4711\nBitte bestätigen.",
    "de comment": "Write the function:\ndef sort_users(users):\n    # Alter aufsteigend\n    pass",
    "de two words": "Ibuprofen ohne Alkohol?",
}


@pytest.mark.parametrize("text", SHORT_PIECES.values(), ids=SHORT_PIECES.keys())
def test_non_english_cut_into_short_lines_or_sentences_does_not_read_as_english(text):
    assert not reads_english(text)


@pytest.mark.parametrize(
    "text", ["¿PUEDO TOMAR IBUPROFENO SIN ALCOHOL?", "Antibiotika Ohne Milch Einnehmen"]
)
def test_a_sentence_in_capitals_is_read_as_plain_words(text):
    assert not reads_english(text)


@pytest.mark.parametrize(
    "text",
    [
        "Please email likho ki main offer accept nahi karta hoon",
        "Mujhe to meeting confirm karni hai",
        "Is order ko cancel kar do",
    ],
)
def test_romanised_hindi_does_not_read_as_english(text):
    assert not reads_english(text)


#: English naming places, people, books and acronyms that spell another language's function
#: word ("las", "che", "das", "ist", "apa", "ces", "il", "di").
NAMED = [
    "What are the best things to do in Los Angeles?",
    "Cheap hotels in Las Vegas for a weekend?",
    "Why was Quora unavailable on 27th August 2016, by 12 pm (IST)?",
    "How do I cite a website in APA format?",
    "What is new at CES this year?",
    "Explain DI in Spring Boot.",
    "Is Lake Como worth visiting in winter?",
    "Who was Che Guevara?",
    "What is the sales tax in IL?",
    "Who do you think is a better author? Ashwin Sanghi or Amish Tripathi?",
]


@pytest.mark.parametrize("text", NAMED)
def test_english_naming_foreign_looking_names_and_acronyms_reads_as_english(text):
    assert reads_english(text)


@pytest.mark.parametrize(
    "text",
    ["It's improbable.", "Compare:\n1. Python\n2. Rust\n3. Go", "Which OS? Ubuntu or Mint?"],
)
def test_short_english_lines_with_a_marker_or_known_words_read_as_english(text):
    assert reads_english(text)


@pytest.mark.parametrize(
    "text",
    [
        "You are the support assistant of Example Shop. Answer in two short paragraphs, in "
        "plain English, without links. Escalate legal questions.",
        "Summarize the following article in three bullet points. Keep technical terms. "
        "Avoid speculation.",
        "Translate the text below into French. Preserve formatting. Output only the translation.",
        "Act as a senior Python reviewer. Point out bugs first. Suggest fixes briefly.",
        "List five healthy breakfast ideas. Include calories per serving.",
        "Explain quantum entanglement simply. Use an analogy. Avoid equations.",
    ],
)
def test_an_instructions_terse_sentences_read_as_english(text):
    # Imperatives without a function word English alone has ("Avoid speculation."): refused
    # by the markers alone, a system prompt of them was never compared by meaning.
    assert reads_english(text)


@pytest.mark.parametrize(
    "text",
    [
        "Quelle planète est plus grande, Mars ou Vénus ?",
        "Qual é a capital de Portugal?",
        "Quanto fa 7 per 6?",
        "Quid est veritas?",
    ],
)
def test_a_question_in_another_language_does_not_read_as_english(text):
    assert not reads_english(text)
