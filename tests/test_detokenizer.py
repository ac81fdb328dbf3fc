"""IncrementalDetokenizer against tokenizer.decode: random ids (special tokens included) fed a few at
a time, characters that span several byte-level tokens, stop strings that span tokens, hold-back and
flush of streamed text. Tokenizers: the project's test tokenizer and two trained here."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server.detokenizer import CONTEXT_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer, stop_hit

MULTIBYTE_TEXT = [
    "naïve café 日本語 emoji 🚀 and more 🚀🔥✨ rockets",
    "Grüße aus Köln, ñandú, façade, Ünïcödé",
    "東京は日本の首都です。日本語のテキスト",
    "κόσμε ελληνικά, русский текст, עברית",
    "plain ascii text about cafés and naïve rockets 🚀",
]
SPECIALS = ["<s>", "</s>", "<|tool|>"]


@pytest.fixture(scope="module")
def project_tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="module")
def multibyte_tok():
    """Byte-level BPE with few merges: most non-ASCII characters span two to four tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(MULTIBYTE_TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(params=["project", "multibyte"])
def tok(request, project_tok, multibyte_tok):
    return project_tok if request.param == "project" else multibyte_tok


def special_ids(tok) -> list[int]:
    return sorted(tok.added_tokens_decoder)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1, finish: bool = True) -> list[str]:
    """Feed ids `chunk` at a time, taking a delta after each add (and a final flush when finish)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        stopped = detok.add_tokens(ids[i:i + chunk]) is not None
        deltas.append(detok.take_delta(stopped))
        if stopped:
            return deltas
    if finish:
        deltas.append(detok.take_delta(True))
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_random_ids_match_decode(tok, skip_special_tokens, chunk):
    rng = random.Random(chunk * 2 + skip_special_tokens)
    specials, vocab = special_ids(tok), len(tok)
    for _ in range(25):
        def draw(n: int) -> list[int]:
            return [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)]

        prompt, out = draw(rng.randint(1, 10)), draw(rng.randint(1, 40))
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        streamed = ""
        for i in range(0, len(out), chunk):
            assert detok.add_tokens(out[i:i + chunk]) is None
            assert detok.text == tok.decode(out[:i + chunk], skip_special_tokens=skip_special_tokens)
            streamed += detok.take_delta(False)
            assert detok.text.startswith(streamed)
        streamed += detok.take_delta(True)
        assert detok.token_ids == out
        assert detok.text == tok.decode(out, skip_special_tokens=skip_special_tokens)
        assert streamed == detok.text
        assert detok.take_delta(True) == ""
        if REPLACEMENT_CHAR not in detok.text:
            assert REPLACEMENT_CHAR not in streamed


def test_characters_spanning_tokens_are_never_streamed_half(tok):
    for text in MULTIBYTE_TEXT:
        ids = tok.encode(text)
        split = [i for i in ids if REPLACEMENT_CHAR in tok.decode([i])]
        assert split, "the test needs characters that span several tokens"
        prompt = tok.encode("Once upon a time")
        for chunk in (1, 2):
            detok = IncrementalDetokenizer(tok, prompt)
            deltas = feed(detok, ids, chunk)
            assert all(REPLACEMENT_CHAR not in d for d in deltas)
            assert "".join(deltas) == detok.text == text


def test_incomplete_character_held_until_its_last_byte(multibyte_tok):
    ids = multibyte_tok.encode("🚀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(multibyte_tok, multibyte_tok.encode("go "))
    for i in ids[:-1]:
        detok.add_tokens([i])
        assert detok.text.endswith(REPLACEMENT_CHAR)  # text is decode's, partial character included
        assert detok.take_delta(False) == ""
    detok.add_tokens(ids[-1:])
    assert detok.take_delta(False) == "🚀"


def test_trailing_incomplete_character_flushed_at_finish(multibyte_tok):
    full = multibyte_tok.encode("ok 漢字")  # not in the training text: one byte a token
    cut = next(k for k in range(len(full)) if multibyte_tok.decode(full[:k]).endswith(REPLACEMENT_CHAR))
    ids, expected = full[:cut], multibyte_tok.decode(full[:cut])  # ends inside a character
    detok = IncrementalDetokenizer(multibyte_tok, [5])
    deltas = feed(detok, ids, finish=False)
    assert "".join(deltas) == expected.rstrip(REPLACEMENT_CHAR)
    assert detok.take_delta(True) == REPLACEMENT_CHAR
    assert detok.text == expected


def test_prompt_ending_inside_a_character(multibyte_tok):
    ids = multibyte_tok.encode("漢字 ok")
    prompt, out = ids[:1], ids[1:]  # the prompt holds the first byte of 漢 only
    assert multibyte_tok.decode(prompt) == REPLACEMENT_CHAR
    detok = IncrementalDetokenizer(multibyte_tok, prompt)
    deltas = feed(detok, out)
    assert detok.text == multibyte_tok.decode(out) == "".join(deltas)


def spanning_stop(tok, text: str, stop: str) -> list[int]:
    """ids of text, checked to put a token boundary inside the first occurrence of stop."""
    ids = tok.encode(text)
    at, ends = text.index(stop), [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert any(at < e < at + len(stop) for e in ends), f"{stop!r} is one token: pick another"
    return ids


@pytest.mark.parametrize("text,stop", [("The answer is 42.\nDone. More text", "42.\nDone"),
                                       ("naïve café 日本語 emoji 🚀 rest", "日本語 emoji")])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, text, stop, include):
    ids = spanning_stop(tok, text, stop)
    at = text.index(stop)
    expected = text[:at + len(stop)] if include else text[:at]
    detok = IncrementalDetokenizer(tok, tok.encode("Q: "), stop=["never", stop], include_stop_str_in_output=include)
    streamed = ""
    for k, i in enumerate(ids):
        hit = detok.add_tokens([i])
        if hit is not None:
            break
        streamed += detok.take_delta(False)
        assert text[:at].startswith(streamed)  # no character of the stop string streamed early
    assert hit == stop == detok.stop_reason
    assert len(tok.decode(ids[:k])) < at + len(stop) <= len(tok.decode(ids[:k + 1]))  # the completing token
    assert detok.text == expected
    assert streamed + detok.take_delta(True) == expected


def test_stop_string_never_streamed_before_it_completes(project_tok):
    text, stop = "alpha beta STOP gamma", "STOP"
    ids = spanning_stop(project_tok, text, stop)
    detok = IncrementalDetokenizer(project_tok, [5], stop=[stop])
    streamed = ""
    for i in ids:
        if detok.add_tokens([i]) is not None:
            break
        streamed += detok.take_delta(False)
        assert "S" not in streamed
    assert streamed + detok.take_delta(True) == "alpha beta "


def test_earliest_stop_wins(tok):
    ids = tok.encode("hello world, hello moon")
    for stops in (["world", "lo w"], ["lo w", "world"], ["moon", "o w", "world"]):
        detok = IncrementalDetokenizer(tok, [7], stop=stops)
        assert detok.add_tokens(ids) in ("lo w", "o w")  # all in one step: the earliest start wins
        assert detok.text == "hello world, hello moon"[:"hello world, hello moon".index(detok.stop_reason)]


def test_stop_hit():
    assert stop_hit("abcabc", ["c", "ab"], 0) == (0, "ab")
    assert stop_hit("abcabc", ["ab"], 1) == (3, "ab")
    assert stop_hit("abcabc", ["abc", "ab"], 0) == (0, "ab")  # same start: the shorter ends first
    assert stop_hit("abcabc", ["x"], 0) is None
    assert stop_hit("abc", [], 0) is None


def test_stop_in_prompt_does_not_count(tok):
    prompt = tok.encode("Say STOP when done. ST")
    out = tok.encode("OP and go on")
    detok = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    deltas = feed(detok, out)
    assert detok.stop_reason is None
    assert "".join(deltas) == detok.text == tok.decode(out)


def test_possible_stop_prefix_held_then_released_or_flushed(project_tok):
    detok = IncrementalDetokenizer(project_tok, [9], stop=["STOP"])
    assert "".join(feed(detok, project_tok.encode("go ST"), finish=False)) == "go "  # "ST" may begin STOP
    detok.add_tokens(project_tok.encode("ar"))
    assert detok.take_delta(False) == "STar"  # it did not
    detok.add_tokens(project_tok.encode(" S"))
    assert detok.take_delta(False) == " "
    assert detok.take_delta(True) == "S"  # finished: held text is flushed
    assert detok.text == "go STar S"


def test_add_after_stop_raises(project_tok):
    detok = IncrementalDetokenizer(project_tok, [9], stop=["b"])
    assert detok.add_tokens(project_tok.encode("abc")) == "b"
    assert detok.text == "a"
    with pytest.raises(RuntimeError, match="already stopped"):
        detok.add_tokens([5])


def test_empty_stop_string_rejected(project_tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(project_tok, [9], stop=["ok", ""])


def test_no_stop_and_empty_adds(project_tok):
    detok = IncrementalDetokenizer(project_tok, [], stop=None)
    assert detok.add_tokens([]) is None
    assert "".join(feed(detok, project_tok.encode("hi there"))) == detok.text == "hi there"


def test_prompt_gives_left_context():
    """sentencepiece-style (Metaspace) decoders drop the first token's leading space; decoded after
    the prompt, the first generated word keeps it, as in vLLM."""
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(["hello world", "hello there world", "world hello"] * 5,
                           trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", bos_token="<s>")
    prompt, both = tok.encode("hello"), tok.encode("hello world")
    out = both[len(prompt):]
    assert both[:len(prompt)] == prompt and tok.decode(out) == "world"
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(feed(detok, out)) == detok.text == " world"
    # a skipped special token first: the window keeps the prompt as context across it
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(feed(detok, [tok.bos_token_id] + out)) == detok.text == " world"


def test_each_step_decodes_a_window(project_tok):
    """Per step, decode sees the window, never the whole sequence."""
    class Counting:
        def __init__(self):
            self.sizes: list[int] = []

        def decode(self, ids, **kw):
            self.sizes.append(len(ids))
            return project_tok.decode(ids, **kw)

    counting = Counting()
    text = " ".join(MULTIBYTE_TEXT) * 3
    ids = project_tok.encode(text)
    detok = IncrementalDetokenizer(counting, ids[:20], stop=["zzz"])
    feed(detok, ids)
    assert detok.text == text and len(ids) > 200
    assert max(counting.sizes) <= CONTEXT_TOKENS + 8
