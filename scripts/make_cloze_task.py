#!/usr/bin/env python3
"""Writes data/eval/shakespeare_cloze.jsonl: a multiple-choice task (`kiln eval --task`)
from tinyshakespeare's held-out documents (kiln's own validation split, the FNV-1a hash of
src/data/dataset.cpp), so a model trained on the bundled corpus never saw its texts; and
data/eval/shakespeare_held_out.txt, those documents as one text (`kiln eval --text`).

Each example: a speech's first lines as the context, and as choices its true next line
and three next lines of other held-out speeches of similar length (deterministic: seeded).
Chance is 25%; a model that learned the corpus's language does better.

usage: scripts/make_cloze_task.py [--count 100] [--out data/eval/shakespeare_cloze.jsonl]
                                  [--text-out data/eval/shakespeare_held_out.txt]
"""

import argparse
import json
import random

from check_common import held_out_documents


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--text", default="data/tinyshakespeare.txt")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--out", default="data/eval/shakespeare_cloze.jsonl")
    p.add_argument("--text-out", default="data/eval/shakespeare_held_out.txt")
    a = p.parse_args()
    docs, _, _ = held_out_documents(a.text, 0.05, 0, 10**9)
    with open(a.text_out, "wb") as f:  # the corpus's own layout: documents between blank lines
        f.write(b"\n\n".join(docs) + b"\n")
    print(f"{a.text_out}: {len(docs)} held-out documents")
    # (context, next line) of speeches with a speaker line and at least two more lines.
    pairs = []
    for d in docs:
        lines = d.decode("utf-8").split("\n")
        if len(lines) < 3:
            continue
        cut = min(len(lines) - 1, 3)
        context = "\n".join(lines[:cut]) + "\n"
        answer = lines[cut]
        if 10 <= len(answer) <= 60:
            pairs.append((context, answer))
    rng = random.Random(1234)
    rng.shuffle(pairs)
    examples = []
    for i, (context, answer) in enumerate(pairs[: a.count]):
        others = [b for j, (_, b) in enumerate(pairs) if j != i and abs(len(b) - len(answer)) <= 12 and b != answer]
        choices = [answer] + rng.sample(others, 3)
        rng.shuffle(choices)
        examples.append({"context": context, "choices": choices, "answer": choices.index(answer)})
    with open(a.out, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")
    print(f"{a.out}: {len(examples)} examples from {len(pairs)} held-out speeches")


if __name__ == "__main__":
    main()
