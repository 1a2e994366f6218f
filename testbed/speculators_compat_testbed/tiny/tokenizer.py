"""Tiny checkpoints: the tokenizer.

A small byte-level BPE tokenizer trained on a fixed in-code corpus (pseudo-random word sequences,
no global RNG), padded to exactly the model's vocabulary size so every id decodes; extra special
tokens (llava's image token, Kimi-K2.5's media tokens) take the last ids.

tokenizers / transformers are imported lazily inside :func:`_build_tokenizer`.
"""

from __future__ import annotations

_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "speculative decoding draft model target verify accept reject token tokens hidden state "
    "states layer layers residual stream norm attention head heads query key value cache "
    "block page batch sequence prompt generate sample greedy logits vocabulary embedding "
    "expert experts router routing gate mixture dense sparse rotary position window sliding "
    "quick brown fox jumps over lazy dog hello world once upon time there lived small "
    "robot who liked numbers zero one two three four five six seven eight nine ten hundred "
    "thousand million question answer why how what when where which who because therefore "
    "python code function return import class def if else while for loop value list dict"
).split()


def _corpus() -> list[str]:
    """A fixed, deterministic corpus (pseudo-random word sequences, no global RNG)."""
    lines = []
    x = 2463534242
    for _ in range(3000):
        words = []
        for _ in range(12):
            x ^= (x << 13) & 0xFFFFFFFF
            x ^= x >> 17
            x ^= (x << 5) & 0xFFFFFFFF
            words.append(_WORDS[x % len(_WORDS)])
        lines.append(" ".join(words) + ".")
    lines.append("0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return lines


def _build_tokenizer(vocab_size: int, extra_special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Pad to exactly vocab_size so every id the model can emit decodes; extra_special
    # (e.g. llava's "<image>") take the last ids.
    n = tok.get_vocab_size()
    target = vocab_size - len(extra_special)
    if n > target:
        raise ValueError(f"BPE vocabulary ({n}) leaves no room for {extra_special}")
    if n < target:
        tok.add_special_tokens([f"<extra_{i}>" for i in range(target - n)])
    if extra_special:
        tok.add_special_tokens(list(extra_special))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    # Prepend BOS like Llama-style tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=4096,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast
