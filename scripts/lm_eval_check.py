#!/usr/bin/env python3
"""`kiln eval` checked against lm-evaluation-harness (PyPI lm-eval) run through `kiln serve`
with its `local-completions` model: the same model, task and text scored both ways. Run by
hand (not in CI: lm-eval and its dependencies are large). CPU only.

  1. `kiln export hf MODEL OUT/hf`: the tokenizer lm-eval tokenizes with (tokenizer.json).
  2. A local multiple-choice task (the JSONL of `kiln eval --task`, as an lm-eval YAML task
     with target_delimiter "", so both score the choices as written) and a local text
     (a loglikelihood_rolling task: word/byte perplexity, bits per byte).
  3. `kiln serve MODEL --device cpu`; lm-eval's local-completions against it, twice: with
     add_bos_token=True (its contexts start with BOS, as `kiln eval`'s default) for the task,
     and with add_bos_token=False for the task again and the text (`kiln eval --no-bos`:
     contexts without BOS; the text's first window is BOS alone either way). lm-eval's
     max_length is the model's context; it scores at most one token less a request (it keeps
     one for the token local-completions asks to generate), which is what `kiln eval
     --max-length` gets.
  4. `kiln eval ... --json --samples` both ways; compared: every choice's log-likelihood
     (lm-eval's logged samples), acc, acc_norm, and the text's metrics.
Writes OUT/lm_eval_check.json and prints a table; exits 1 if a log-likelihood differs by
more than 1e-4 (relative) or a metric differs.

usage: lm_eval_check.py --kiln BIN --model MODEL_DIR --task TASK.jsonl --text TEXT.txt --out DIR
"""

import argparse
import glob
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url, server, seconds=120):
    start = time.time()
    while time.time() - start < seconds:
        if server.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


def write_tasks(out, task_jsonl, text_path):
    """lm-eval YAML tasks over local files: the multiple-choice task and the rolling text."""
    tasks = os.path.join(out, "tasks")
    os.makedirs(tasks, exist_ok=True)
    text_jsonl = os.path.join(tasks, "text.jsonl")
    with open(text_path, encoding="utf-8") as f, open(text_jsonl, "w", encoding="utf-8") as g:
        g.write(json.dumps({"text": f.read()}) + "\n")
    with open(os.path.join(tasks, "kiln_mc.yaml"), "w") as f:
        f.write(f"""task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {os.path.abspath(task_jsonl)}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    with open(os.path.join(tasks, "kiln_text.yaml"), "w") as f:
        f.write(f"""task: kiln_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {text_jsonl}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return tasks


def lm_eval(tasks_dir, task_names, port, tokenizer, max_length, bos, out):
    args = (f"model=kiln,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tokenizer},"
            f"tokenizer_backend=huggingface,max_length={max_length},add_bos_token={bos},"
            f"num_concurrent=1,max_retries=1")
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's results would be read too
    run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
         "--tasks", ",".join(task_names), "--include_path", tasks_dir, "--batch_size", "4",
         "--output_path", out, "--log_samples"])
    [results] = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    metrics = json.load(open(results))["results"]
    samples = {}
    for name in task_names:
        [path] = glob.glob(os.path.join(out, "**", f"samples_{name}_*.jsonl"), recursive=True)
        rows = [json.loads(line) for line in open(path)]
        samples[name] = sorted(rows, key=lambda r: r["doc_id"])
    return metrics, samples


def close(a, b, rel=1e-4):
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kiln", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--task", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    context = tomllib.load(open(os.path.join(a.model, "config.toml"), "rb"))["model"]["max_seq_len"]
    # lm-eval's API models keep one token of max_length for the generated one (TemplateAPI:
    # self.max_length = max_length - 1): given the model's context, they score at most
    # context - 1 tokens a request, and a rolling window predicts context - 2.
    max_length = context - 1

    hf = os.path.join(a.out, "hf")
    shutil.rmtree(hf, ignore_errors=True)
    run([a.kiln, "export", "hf", a.model, hf])
    tasks_dir = write_tasks(a.out, a.task, a.text)

    kiln = {}
    for bos in (True, False):
        path = os.path.join(a.out, f"kiln_eval_bos{int(bos)}.json")
        run([a.kiln, "eval", a.model, "--device", "cpu", "--task", a.task, "--text", a.text, "--max-length",
             str(max_length), "--json", path, "--samples"] + ([] if bos else ["--no-bos"]))
        kiln[bos] = json.load(open(path))

    port = free_port()
    server = subprocess.Popen([a.kiln, "serve", a.model, "--device", "cpu", "--port", str(port), "--model-name", "kiln",
                               "--max-prompts", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(f"http://127.0.0.1:{port}/v1/models", server)
        harness = {True: lm_eval(tasks_dir, ["kiln_mc"], port, hf, context, True, os.path.join(a.out, "lm_eval_bos1")),
                   False: lm_eval(tasks_dir, ["kiln_mc", "kiln_text"], port, hf, context, False,
                                  os.path.join(a.out, "lm_eval_bos0"))}
    finally:
        server.terminate()
        server.wait(timeout=30)

    task = os.path.splitext(os.path.basename(a.task))[0]
    text = os.path.splitext(os.path.basename(a.text))[0]
    failures, report = [], {}
    for bos in (True, False):
        metrics, samples = harness[bos]
        mine = kiln[bos]["tasks"][task]
        worst = 0.0
        for row, choices in zip(samples["kiln_mc"], mine["samples"], strict=True):
            theirs = [r[0] for r in row["resps"]]  # each [[ll, is_greedy]]
            for (ll, _), (my_ll, _) in zip(theirs, choices, strict=True):
                worst = max(worst, abs(float(ll) - my_ll) / max(1.0, abs(my_ll)))
                if not close(float(ll), my_ll):
                    failures.append(f"bos={bos} doc {row['doc_id']}: lm-eval {ll} vs kiln {my_ll}")
        entry = {"examples": mine["examples"], "max_rel_ll_diff": worst}
        for m in ("acc", "acc_norm"):
            theirs = metrics["kiln_mc"][f"{m},none"]
            entry[m] = {"lm_eval": theirs, "kiln": mine[m]}
            if not close(theirs, mine[m], 1e-9):
                failures.append(f"bos={bos} {m}: lm-eval {theirs} vs kiln {mine[m]}")
        report[f"task_bos{int(bos)}"] = entry
    metrics, _ = harness[False]
    mine = kiln[False]["texts"][text]
    entry = {}
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        theirs = metrics["kiln_text"][f"{m},none"]
        entry[m] = {"lm_eval": theirs, "kiln": mine[m]}
        if not close(theirs, mine[m]):
            failures.append(f"text {m}: lm-eval {theirs} vs kiln {mine[m]}")
    report["text"] = entry
    report["failures"] = failures
    json.dump(report, open(os.path.join(a.out, "lm_eval_check.json"), "w"), indent=2)

    print(f"{'check':<28} {'lm-eval':>14} {'kiln eval':>14}")
    for bos in (True, False):
        e = report[f"task_bos{int(bos)}"]
        for m in ("acc", "acc_norm"):
            print(f"{f'{task} {m} (bos={bos})':<28} {e[m]['lm_eval']:>14.6f} {e[m]['kiln']:>14.6f}")
        print(f"{f'{task} max ll diff (bos={bos})':<28} {e['max_rel_ll_diff']:>29.2e}")
    for m, v in report["text"].items():
        print(f"{f'{text} {m}':<28} {v['lm_eval']:>14.6f} {v['kiln']:>14.6f}")
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
