"""Hugging Face `tokenizers` as the oracle for kiln's BPE tests (tests/test_bpe_hf.cpp).

  build OUT_DIR CORPUS...      trains small byte-level BPE tokenizers the way GPT-2,
                               Llama-3 and Qwen2 are configured, one folder per style
  encode OUT_JSON TEXTS_JSON TOKENIZER_JSON...
                               {tokenizer: {"ids": [[...] per text], "decoded": [...]}}
                               (encode with add_special_tokens=False, as kiln's encode)
  check-config DIR             loads DIR/tokenizer.json and checks tokenizer_config.json
                               is what PreTrainedTokenizerFast needs
"""
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train(tokenizer, corpus, vocab_size, specials):
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(corpus, trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def save(tokenizer, out_dir, name, edit=None):
    os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    path = os.path.join(out_dir, name, "tokenizer.json")
    tokenizer.save(path)
    if edit:
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        edit(j)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        Tokenizer.from_file(path)  # still loads


def build(out_dir, corpus):
    # GPT-2: ByteLevel pre-tokenizer with its own regex; merges saved as given by tokenizers.
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    train(gpt2, corpus, 1500, ["<|endoftext|>"])
    save(gpt2, out_dir, "gpt2")

    def legacy_merges_and_prefix_space(j):  # "a b" merges, ByteLevel add_prefix_space
        j["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
        j["pre_tokenizer"]["add_prefix_space"] = True
    save(gpt2, out_dir, "gpt2-prefix", legacy_merges_and_prefix_space)

    # Llama-3: Split(regex, Isolated) + ByteLevel(use_regex=False), ignore_merges, many specials.
    llama = Tokenizer(models.BPE(ignore_merges=True))
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(8)]
    train(llama, corpus, 2000, specials)
    save(llama, out_dir, "llama3", lambda j: j["model"].__setitem__("ignore_merges", True))

    # Qwen2: NFC normalizer, Split + ByteLevel, specials plus added tokens with options.
    qwen = Tokenizer(models.BPE())
    qwen.normalizer = normalizers.NFC()
    qwen.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    train(qwen, corpus, 2500, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    qwen.add_tokens([AddedToken("thee", single_word=True), AddedToken("[kiln added]", normalized=True),
                     AddedToken("café", normalized=True)])
    qwen.add_special_tokens([AddedToken("<|mask|>", lstrip=True, rstrip=True, special=True, normalized=False)])
    save(qwen, out_dir, "qwen2")


def decode(tok, ids):
    """tok.decode(ids, skip_special_tokens=True), except that non-special added tokens are
    written verbatim: tokenizers runs their content through the ByteLevel decoder, which
    turns a non-ASCII added token such as "café" into invalid UTF-8 (U+FFFD); kiln does not."""
    added = tok.get_added_tokens_decoder()
    out, run = [], []
    for i in ids + [None]:
        if i is None or i in added:
            out.append(tok.decode(run, skip_special_tokens=True))
            run = []
            if i is not None and not added[i].special:
                out.append(added[i].content)
        else:
            run.append(i)
    return "".join(out)


def encode(out_json, texts_json, paths):
    with open(texts_json, encoding="utf-8") as f:
        texts = json.load(f)
    result = {}
    for path in paths:
        tok = Tokenizer.from_file(path)
        ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        decoded = [decode(tok, i) for i in ids]
        result[path] = {"ids": ids, "decoded": decoded}
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)


def check_config(directory):
    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast", config
    assert isinstance(config["model_max_length"], int)
    for key in ("bos_token", "eos_token", "pad_token"):
        assert tok.token_to_id(config[key]) is not None, (key, config[key])
    for id_str, entry in config["added_tokens_decoder"].items():
        assert tok.token_to_id(entry["content"]) == int(id_str), entry
    print("config ok", tok.get_vocab_size())


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "build":
        build(args[0], args[1:])
    elif command == "encode":
        encode(args[0], args[1], args[2:])
    elif command == "check-config":
        check_config(args[0])
    else:
        sys.exit(f"unknown command {command}")
