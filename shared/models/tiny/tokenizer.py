"""Deterministic byte-level BPE tokenizer for the built-in tiny models.

The training corpus is built inside the repo (an embedded English text plus a seeded synthetic
generator), so every machine trains the same merges: ``random.Random`` with an int seed is stable
across platforms and Python versions, and the ``tokenizers`` BPE trainer breaks count ties by
pair id, independent of thread count. Files are written by hand rather than with
``save_pretrained`` so their contents do not depend on the installed transformers version
(v5 moved the chat template out of tokenizer_config.json and dropped special_tokens_map.json).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trainer places special tokens first, so their ids are 0, 1, 2 for every vocab size.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS_SEED = 20240611

_ENGLISH_TEXT = """\
The river town woke slowly. Fishermen pushed their boats into the grey water while the baker
opened his shutters and the smell of warm bread drifted down the narrow streets. Children ran
to school with their books under their arms, and an old dog watched them from the steps of the
library. Nobody in the town was in a hurry, because the river had taught them patience.
A traveller arrived at noon. She carried a small leather bag, a map folded many times, and a
notebook full of questions. "Where does the road go after the bridge?" she asked the baker.
He thought for a while and said, "It goes to the hills, then to the sea, and then it comes back
here. Every road does, if you wait long enough."
In the afternoon the wind changed. Clouds gathered over the hills, and the first drops of rain
fell on the roofs. The traveller sat by the window of the inn and wrote: the water is calm, the
people are kind, and the bread is the best I have eaten in years. She counted her coins, paid
for a second cup of tea, and listened to the stories of the sailors.
Computers read text as numbers. A tokenizer splits a sentence into pieces, and each piece has an
id. A language model reads the ids, predicts the next one, and the tokenizer turns the ids back
into text. When the pieces are bytes, every string can be written, in every language: English,
French, German, Chinese, or a line of emoji. Servers batch many requests together, keep a cache
of keys and values for every token they have seen, and send the new tokens back as a stream.
Question: how many apples are left if you have twelve and give away five? Answer: seven.
Question: what is the capital of France? Answer: Paris is the capital of France.
"""

_WORDS = {
    "name": "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent",
    "noun": "apple river stone window garden letter engine kernel server queue token cache "
    "block bridge mountain forest market cloud signal number story answer question model "
    "request batch stream memory village harbour lantern",
    "verb": "finds carries opens writes reads sends builds watches counts paints follows keeps "
    "moves returns answers measures",
    "adj": "small quiet bright old green heavy quick gentle empty golden strange warm distant "
    "careful simple",
    "prep": "near under behind beside across through above inside",
    "foreign": "café naïve Zürich über señor façade résumé Ångström smörgåsbord crème brûlée "
    "déjà vu Straße naïveté jalapeño piñata Москва привет Καλημέρα こんにちは 你好 世界 "
    "中文 模型 数据",
}
_SYLLABLES = "ka lo mi ne ru sa te vi zo bu qua ter ing ed an or el is um ra po li da fen".split()
_CODE_LINES = (
    "def {a}_{b}(x, y):\n    return x * {n} + y\n",
    "for i in range({n}):\n    total += values[i]\n",
    "if {a} == {b}:\n    print('{a} {b}')\n",
    "{a}_{b} = [{n}, {m}, {n}]\n",
)


def _synthetic_lines(rng: random.Random, num_lines: int) -> list[str]:
    words = {k: v.split() for k, v in _WORDS.items()}
    made_up = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(2000)
    ]
    emoji = ["🙂", "🚀", "🌍", "✨", "—", "…", "€", "°C"]
    lines: list[str] = []
    for _ in range(num_lines):
        kind = rng.randrange(6)
        n, m = rng.randint(0, 999), rng.randint(0, 99)
        if kind == 0:
            a, b = rng.choice(made_up), rng.choice(words["noun"])
            lines.append(rng.choice(_CODE_LINES).format(a=a, b=b, n=n, m=m))
        elif kind == 1:
            lines.append(
                f"{rng.choice(words['foreign'])} {rng.choice(words['noun'])} "
                f"{rng.choice(words['foreign'])} {rng.choice(emoji)} {n}.\n"
            )
        elif kind == 2:  # chat turns without the ChatML markers (those are added tokens)
            lines.append(
                f"user\nWhat does {rng.choice(made_up)} mean?\n"
                f"assistant\nIt means the {rng.choice(words['adj'])} "
                f"{rng.choice(words['noun'])}.\n"
            )
        else:
            lines.append(
                f"{rng.choice(words['name'])} {rng.choice(words['verb'])} the "
                f"{rng.choice(words['adj'])} {rng.choice(words['noun'])} "
                f"{rng.choice(words['prep'])} {rng.choice(made_up).capitalize()} "
                f"at {n % 24}:{m:02d}, {rng.choice(made_up)} {rng.choice(made_up)}.\n"
            )
    return lines


def build_corpus(num_synthetic_lines: int = 12000) -> list[str]:
    """The training corpus, identical on every machine and run."""
    english = _ENGLISH_TEXT.splitlines(keepends=True)
    return english * 20 + _synthetic_lines(random.Random(CORPUS_SEED), num_synthetic_lines)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly ``vocab_size`` tokens (padded with reserved specials)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus(), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing < 0:
        raise ValueError(f"trainer returned {tokenizer.get_vocab_size()} > {vocab_size} tokens")
    if missing:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with chat_template), special_tokens_map.json."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added_tokens_decoder = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    special_map = {
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "unk_token": None,
        **special_map,
        "added_tokens_decoder": added_tokens_decoder,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
