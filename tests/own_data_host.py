"""A tiny local checkpoint with a real tokenizer, as a user's would be: a Granite-4.0 host of a few thousand
parameters saved with `save_pretrained`, beside a word-level `PreTrainedTokenizerFast` (tokenizers library) with
BOS/EOS, no pad token and a chat template. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

WORDS = [*"abcdefghijklmnopqrstuvwxyz", *map(str, range(10)), "swap", "cups", "->", "hello", "world", "what", "is",
         "the", "answer", "=", "+", "?", ".", ","]
ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def word_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """One token per whitespace-separated word (unknown words -> <unk>); BOS added to every encoded text; no pad
    token (as many causal LMs ship)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", *ROLES]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(specials)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def save_tiny_checkpoint(path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0) -> Path:
    """A tiny Granite-4.0 host (pattern M*M*: two attention blocks) and its tokenizer, saved in `path`."""
    from llm_surgery.hosts import build_tiny_host

    path = Path(path)
    tok = word_tokenizer(chat_template)
    build_tiny_host("granite", seed=seed, hidden_size=32, vocab_size=len(tok), pattern="M*M*",
                    mamba_chunk_size=64).save_pretrained(path)
    tok.save_pretrained(path)
    return path
