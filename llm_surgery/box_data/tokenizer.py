"""A word-level tokenizer for the Box language, for small models trained from scratch and for tests.

One token per word, box number and punctuation mark; `decode` restores the exact text (the WordPiece
decoder's cleanup removes the space before "," and "."). A decoded completion has no leading space
(` is empty` decodes to `is empty`); the scorer ignores that.
"""

from __future__ import annotations

from collections.abc import Iterable

from .generate import NUM_BOXES
from .vocab import COMMON_OBJECTS, RARE_OBJECTS, TEMPLATE_WORDS

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"


def build_box_tokenizer(vocab_words: Iterable[str] | None = None):
    """`PreTrainedTokenizerFast` over the template words, box numbers, punctuation and `vocab_words`
    (default: both object vocabularies), plus `<pad>` (id 0), `<unk>` (1) and `<eos>` (2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(COMMON_OBJECTS + RARE_OBJECTS) if vocab_words is None else list(vocab_words)
    for w in words:
        if not isinstance(w, str) or not w.isalnum():
            raise ValueError(f"vocabulary words must be single alphanumeric words, got {w!r}")
    vocab: dict[str, int] = {}
    for w in [PAD, UNK, EOS, *TEMPLATE_WORDS, *map(str, range(NUM_BOXES)), *words]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([PAD, UNK, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 20)
