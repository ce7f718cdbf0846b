"""Text of a growing output, decoded incrementally (what a stream hands out as rounds are accepted)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """The text that each batch of new token ids completes. Decoding the whole output again at every round costs
    O(n) a round, O(n^2) a stream; this decodes only a window: the tokens since the text last handed out, after
    the ones just before them (a token's text can depend on its neighbour's, e.g. SentencePiece's leading space),
    and takes what the new tokens add (the approach of TGI's and vLLM's incremental detokenizers). A multi-byte
    character split across tokens waits for its rest. The texts handed out add up to decode(all ids); where a
    decoder would not keep a window's text a prefix of the longer window's, the whole output is decoded instead."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: at the tokens of the text handed out last
        self._read = 0  # tokens whose text has been handed out
        self._shown = 0  # characters handed out

    def add(self, new: Sequence[int], final: bool = False) -> str:
        """The text `new` completes ("" while a character is split, unless `final`: then whatever is left)."""
        self.ids.extend(int(t) for t in new)
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if not final and text.endswith("\ufffd"):
            return ""
        if text.startswith(before):
            delta = text[len(before):]
        else:  # a decoder whose window texts do not extend each other
            delta = self._decode(self.ids)[self._shown:]
        self._prefix, self._read = self._read, len(self.ids)
        self._shown += len(delta)
        return delta
