"""TextStream: incremental decoding whose pieces add up to the whole decode, without decoding the whole each time."""

import random

import pytest
from tokenizers import Tokenizer

from specrt.checkpoints import DEMO_DIR
from specrt.runtime.detokenize import TextStream


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer" / "tokenizer.json"))


def test_pieces_add_up_to_the_whole_text_through_split_characters(tokenizer):
    text = "def f(x):\n    return 'naïve café — 你好, 🙂' * x  # ünïcödé\n" * 3
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    decode = lambda t: tokenizer.decode(list(t), skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    for _ in range(20):
        stream, pieces, i = TextStream(decode), [], 0
        while i < len(ids):
            n = rng.randint(0, 4)
            piece = stream.add(ids[i:i + n])
            assert "\ufffd" not in piece
            pieces.append(piece)
            i += n
        pieces.append(stream.add([], final=True))
        assert "".join(pieces) == decode(ids)


def test_token_ids_may_come_as_numpy_arrays(tokenizer):
    """What Pipeline.stream hands it: slices of a sequence's numpy array of new tokens."""
    import numpy as np

    ids = np.array(tokenizer.encode("def f(x): return x", add_special_tokens=False).ids)
    stream = TextStream(lambda t: tokenizer.decode(list(t)))
    assert stream.add(ids[:3]) + stream.add(ids[3:]) + stream.add(ids[:0], final=True) == tokenizer.decode(ids.tolist())
    assert all(type(t) is int for t in stream.ids)


def test_each_add_decodes_a_window_not_the_whole_output(tokenizer):
    ids = tokenizer.encode("x = 1\n" * 400, add_special_tokens=False).ids
    widths = []

    def decode(t):
        widths.append(len(t))
        return tokenizer.decode(list(t))

    stream = TextStream(decode)
    for i in range(0, len(ids), 3):
        stream.add(ids[i:i + 3])
    assert max(widths) <= 6 and len(ids) > 600  # the whole output would be decoded at every call without the window


def test_sentencepiece_leading_spaces_survive_the_window():
    """Metaspace decoders (Llama 2, Mistral) drop the first token's leading space: a window's first token too, which
    is why the window starts one text before the new tokens."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(["hello world, foo bar baz qux"] * 50, trainers.BpeTrainer(vocab_size=60,
                                                                                    special_tokens=["<unk>"]))
    ids = tok.encode("hello world foo  bar baz, qux hello").ids
    decode = lambda t: tok.decode(list(t))  # noqa: E731
    stream = TextStream(decode)
    assert "".join(stream.add([t]) for t in ids) + stream.add([], final=True) == decode(ids)


def test_a_decoder_whose_windows_disagree_falls_back_to_the_whole(tokenizer):
    decode = lambda t: f"[{len(t)}]" + tokenizer.decode(list(t))  # noqa: E731  (a window is no prefix of the next)
    ids = tokenizer.encode("a  b   c    d", add_special_tokens=False).ids
    stream = TextStream(decode)
    out = [stream.add([t]) for t in ids] + [stream.add([], final=True)]
    whole, shown = [], ""  # what decoding the whole output at every step hands out
    for i in range(1, len(ids) + 1):
        text = decode(ids[:i])
        whole.append(text[len(shown):] if len(text) > len(shown) else "")
        shown = max(shown, text, key=len)
    assert out[:-1] == whole and out[-1] == ""
