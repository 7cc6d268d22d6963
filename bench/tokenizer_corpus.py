"""Writes the tokenizer benchmark corpus: data/tinyshakespeare.txt followed by a seeded
synthetic multilingual text (Zipf-distributed invented words in Latin with diacritics,
Cyrillic, Greek, Arabic, Devanagari, Hangul and CJK, plus numbers, punctuation, emoji,
code-like lines and blank-line paragraph breaks), so a 32K vocabulary has enough
distinct material. Usage: tokenizer_corpus.py OUT MEGABYTES [SEED]"""
import random
import sys

SCRIPTS = {  # name: (alphabet, word length range, joiner between words)
    "latin": ("abcdefghijklmnopqrstuvwxyzéèàüöäçñß", (2, 9), " "),
    "cyrillic": ("абвгдеёжзийклмнопрстуфхцчшщыьэюя", (2, 10), " "),
    "greek": ("αβγδεζηθικλμνξοπρστυφχψωάέήίόύώ", (2, 9), " "),
    "arabic": ("ابتثجحخدذرزسشصضطظعغفقكلمنهوي", (2, 7), " "),
    "devanagari": ("कखगघचछजझटठडढणतथदधनपफबभमयरलवशसह" + "ािीुूेैोौं्", (2, 7), " "),
    "hangul": ("".join(chr(0xAC00 + 37 * i) for i in range(300)), (1, 4), " "),
    "cjk": ("".join(chr(0x4E00 + 7 * i) for i in range(2500)), (1, 3), ""),
}


def make_lexicon(rng, alphabet, lengths, size):
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(alphabet) for _ in range(rng.randint(*lengths))))
    words = sorted(words)
    rng.shuffle(words)  # Zipf rank independent of spelling
    return words


def main():
    out, megabytes = sys.argv[1], float(sys.argv[2])
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1234)
    with open("data/tinyshakespeare.txt", encoding="utf-8") as f:
        parts = [f.read()]
    lexicons = {name: make_lexicon(rng, a, l, 4000) for name, (a, l, _) in SCRIPTS.items()}
    weights = [1.0 / (r + 1) ** 1.1 for r in range(4000)]  # Zipf
    target = int(megabytes * 1e6)
    size = len(parts[0].encode())
    emoji = ["🙂", "👍🏽", "🔥", "❤️", "🇯🇵", "👨‍👩‍👧"]
    while size < target:
        name = rng.choice(list(SCRIPTS))
        joiner = SCRIPTS[name][2]
        sentences = []
        for _ in range(rng.randint(1, 6)):
            words = rng.choices(lexicons[name], weights, k=rng.randint(4, 18))
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 7))))
            if rng.random() < 0.1:
                words.append(rng.choice(emoji))
            sentence = joiner.join(words)
            sentences.append(sentence[:1].upper() + sentence[1:] + rng.choice([".", ".", ",", "!", "?", ";", ":"]))
        paragraph = " ".join(sentences)
        if rng.random() < 0.05:
            paragraph = "    " + "def f(x):\n        return x * " + str(rng.randint(1, 99)) + "  # " + paragraph[:40]
        parts.append(paragraph)
        size += len(paragraph.encode()) + 2
    with open(out, "w", encoding="utf-8", newline="") as f:
        f.write("\n\n".join(parts))


if __name__ == "__main__":
    main()
