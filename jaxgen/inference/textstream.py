"""Streaming text exactly: deltas whose concatenation is the final text, character for character.

A sequence's text is decoded again after every chunk of decode steps. Two things make a naive
"send what is new" wrong:
- a chunk can end inside a multi-byte UTF-8 character (a byte-level or byte-fallback tokenizer splits
  them over several tokens): the partial decode ends in U+FFFD, which the final text does not have;
- a stop string can be half generated: its first characters must not be sent, since the final text
  is cut before it.
`TextDeltas` holds both back until they are settled. It also says which tokens the sent text covers,
so that per-token log-probabilities stream with the text they belong to.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of an unfinished character


class TextDeltas:
    """Turns successive full decodes of a growing sequence into exact deltas.

    hold: characters always held back before the end (the longest stop string's length minus one).
    """

    def __init__(self, tokenizer, hold: int = 0):
        self.tokenizer, self.hold = tokenizer, hold
        self.sent = ""  # text sent so far
        self.tokens_sent = 0  # tokens whose text lies wholly inside `sent`

    def update(self, text: str, final: bool = False) -> str:
        """The next delta for the sequence's current full text (the final text when `final`)."""
        if final:
            delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        else:
            settled = text.rstrip(REPLACEMENT)  # an unfinished character is completed by later tokens
            upto = len(settled) - self.hold
            delta = settled[len(self.sent) : upto] if upto > len(self.sent) and settled.startswith(self.sent) else ""
        self.sent += delta
        return delta

    def new_tokens(self, tokens: list[int], final: bool = False) -> tuple[int, int]:
        """(start, end): the tokens to report with the text sent so far; all of them when `final`."""
        start = self.tokens_sent
        if final:
            self.tokens_sent = len(tokens)
            return start, len(tokens)
        lo, hi = start, len(tokens)  # the largest k whose decode fits in the sent text
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.tokenizer.decode(tokens[:mid])) <= len(self.sent):
                lo = mid
            else:
                hi = mid - 1
        while lo > start and self.tokenizer.decode(tokens[:lo]).endswith(REPLACEMENT):
            lo -= 1  # a token holding the first bytes of a character goes with the character
        self.tokens_sent = lo
        return start, lo
