"""IndexTTS-2.5's languages: the rows of `lang_embedding` and the `<|xx|>` tokens of its tokenizer
(shared/reference/indextts25-gpt.md, section 3).

Upstream enumerates 106 language codes (Whisper's 99, then seven of its own); a code's index is its row of
`lang_embedding` (107 rows: one more than the codes, never indexed), and only the first 99 codes own a
`<|xx|>` special token. A sample's language is one of these codes; see `language_problem` for the choice
made for languages that are not.
"""
from __future__ import annotations

# The 106 codes in upstream's order (indextts/utils/tokenizer.py LANGUAGES): the index is the lang_id.
LANGUAGES: tuple[str, ...] = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id", "hi", "fi",
    "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt", "la", "mi", "ml",
    "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs",
    "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu", "am",
    "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl", "mg", "as", "tt", "haw", "ln",
    "ha", "ba", "jw", "su",
    # upstream's own, with embedding rows but no <|xx|> token
    "yue", "minnan", "wuyu", "dialect", "zh/en", "en/zh", "common",
)
LANGUAGE_IDS: dict[str, int] = {code: i for i, code in enumerate(LANGUAGES)}
LANGUAGE_ROWS = len(LANGUAGES) + 1  # lang_embedding [107, D]
TOKEN_LANGUAGES = 99  # the first 99 codes own a <|xx|> special token
COMMON = "common"  # where upstream's lang_to_token sends an unknown code
# The languages the released 2.5 model was trained on (its README; which rows were trained is unverified).
RELEASED = ("zh", "en", "ja", "es", "ar")

# The special tokens that follow the mergeable ranks of the tiktoken file, in upstream's order
# (tokenizer.py get_encoding): 1673 of them, so n_vocab = ranks + 1673 (58,836 + 1673 = 60,509 for the release).
_AUDIO_EVENTS = ("ASR", "AED", "SER", "Speech", "/Speech", "BGM", "/BGM", "Laughter", "/Laughter", "Applause",
                 "/Applause")
_EMOTIONS = ("HAPPY", "SAD", "ANGRY", "NEUTRAL")
_TASKS = ("translate", "transcribe", "startoflm", "startofprev", "nospeech", "notimestamps")
_TTS = ("TTS/B", "TTS/O", "TTS/Q", "TTS/A", "TTS/CO", "TTS/CL", "TTS/H", *(f"TTS/SP{i:02d}" for i in range(1, 14)))
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|startoftranscript|>",
    *(f"<|{code}|>" for code in LANGUAGES[:TOKEN_LANGUAGES]),
    *(f"<|{event}|>" for event in _AUDIO_EVENTS),
    *(f"<|{emotion}|>" for emotion in _EMOTIONS),
    *(f"<|{task}|>" for task in _TASKS),
    *(f"<|SPECIAL_TOKEN_{i}|>" for i in range(1, 31)),
    *(f"<|{tts}|>" for tts in _TTS),
    *(f"<|{i * 0.02:.2f}|>" for i in range(1501)),
)
assert len(SPECIAL_TOKENS) == 1673


def lang_id(code: str) -> int:
    """The lang_embedding row of a language code (as upstream's lang_to_token: lower-cased)."""
    return LANGUAGE_IDS[code.lower()]


def language_problem(code: str | None) -> str | None:
    """What is wrong with a sample's language for IndexTTS-2.5 (None: it is one of its codes).

    The choice for a language that is not one of the 106 codes: refused, naming the way out. Upstream inference
    would quietly send it to the shared row `common` (105) and read its `<|xx|>` prefix as plain text, so a model
    trained on it speaks that language only where every other unknown language speaks too. It must borrow a code
    instead: one of the first 99 (its `<|xx|>` token and row are then this language's), written as the sample's
    language and passed as `lang` to inference. Codes 99-105 (yue, ..., common) are accepted as upstream uses them:
    their row, and their `<|xx|>` prefix as plain text.
    """
    if code is None:
        return ("no language: an IndexTTS-2.5 sample needs one (its lang_embedding row): add \"language\" (or the 2.5 "
                "preprocessing's \"lang\") to the line, or write the manifest as PATH::LANG")
    if code.lower() in LANGUAGE_IDS:
        return None
    return (f"language {code!r} is not one of IndexTTS-2.5's {len(LANGUAGES)} language codes (upstream inference "
            f"would send it to the shared row {COMMON!r}); borrow the code of a language the model was not trained "
            f"on that has a <|xx|> token (one of the first {TOKEN_LANGUAGES}, e.g. 'tt'), write it as the sample's "
            "language (the 2.5 preprocessing's \"lang_alias\") and pass it as lang to inference "
            "(docs/indextts25.md, \"A new language\")")


def first_language_token(number_text_tokens: int) -> int:
    """The id of `<|en|>`, the first language token: the special tokens follow the ranks, two before it."""
    return number_text_tokens - len(SPECIAL_TOKENS) + 2


def text_language(first_id: int, number_text_tokens: int) -> str | None:
    """ManifestForms.text_language: the language whose `<|xx|>` token `first_id` is (a text's first id: upstream's
    front end begins every text with it), None when it is none (or the vocabulary holds no special tokens)."""
    index = first_id - first_language_token(number_text_tokens)
    if number_text_tokens <= len(SPECIAL_TOKENS) or not 0 <= index < TOKEN_LANGUAGES:
        return None
    return LANGUAGES[index]


def trained_rows(number_text_tokens: int, codes: tuple[str, ...]) -> dict[str, list[int]]:
    """ModelFamily.language_rows: the rows a new language trains (--new-language), by table: its lang_embedding
    row, and where it has one the text rows of its <|xx|> token (id = ranks + 2 + lang_id, the special tokens
    following the ranks). ValueError naming a code that is not one of the 106."""
    unknown = [code for code in codes if code.lower() not in LANGUAGE_IDS]
    if unknown:
        raise ValueError(f"--new-language {','.join(unknown)}: not one of IndexTTS-2.5's {len(LANGUAGES)} language "
                         f"codes; a language that is not borrows the code of one the model was not trained on "
                         f"(docs/indextts25.md, \"A new language\")")
    ids = sorted({lang_id(code) for code in codes})
    rows = {"lang_embedding.weight": ids}
    tokens = [first_language_token(number_text_tokens) + i for i in ids if i < TOKEN_LANGUAGES]
    if tokens:
        rows.update({key: tokens for key in ("text_embedding.weight", "text_head.weight", "text_head.bias")})
    return rows
