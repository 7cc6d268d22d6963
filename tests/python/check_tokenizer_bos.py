#!/usr/bin/env python3
"""Encodes TEXT with an exported tokenizer.json through Hugging Face `tokenizers` (special
tokens added, as transformers does by default) and checks the ids against kiln's: the BOS
kiln puts before every document, then kiln's own encoding.

usage: check_tokenizer_bos.py TOKENIZER_JSON TEXT ID,ID,...
"""

import sys

from tokenizers import Tokenizer


def main():
    path, text, expected = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
    ids = Tokenizer.from_file(path).encode(text).ids
    print(f"tokenizers: {ids}")
    if ids != expected:
        print(f"FAIL: kiln trained on {expected}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
