"""The official `openai` client, unchanged, against `kiln serve` on loopback.

Usage: openai_client_check.py PORT MODEL_NAME PROMPT MAX_TOKENS EXPECTED_FILE CHAT_EXPECTED_FILE

EXPECTED_FILE holds `kiln sample`'s greedy continuation of PROMPT, CHAT_EXPECTED_FILE its
continuation of the chat prompt [{"role": "user", "content": PROMPT}] renders to with
kiln's default template. Checks: models.list and
models.retrieve; completions.create with and without stream=True (the streamed pieces add
up to the same text, usage last with include_usage); max_completion_tokens through
extra_body; an unknown model and an unknown id answered with NotFoundError
model_not_found; n=2 sampled with a seed, each choice equal to an n=1 request with its seed
(seed + index), streamed too (both indices, each adding up to its choice), and best_of with
stream refused naming it; chat.completions.create
with and without stream=True (the role first, then the content adding up to the same
text), its logprobs, and response_format json_object refused naming it; logprobs streamed
(both APIs) joining to the unstreamed ones. Exit 0 when all hold.
"""
import sys

import openai


def main():
    port, name, prompt, max_tokens, expected_file, chat_expected_file = sys.argv[1:7]
    max_tokens = int(max_tokens)
    expected = open(expected_file, encoding="utf-8").read()
    chat_expected = open(chat_expected_file, encoding="utf-8").read()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name

    whole = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert whole.choices[0].text == expected, (whole.choices[0].text, expected)

    text, finish, usage = "", None, None
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        assert usage is None, "a chunk after the usage chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert finish is None, "a chunk after the one with finish_reason"
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason
    assert text == expected, (text, expected)
    assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage
    # A fast model's tokens may come together in one chunk (the server sends what has
    # settled when it gets to write), so the count of chunks is not checked.

    plain = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True))
    assert plain == expected, (plain, expected)

    short = client.completions.create(model=name, prompt=prompt, temperature=0,
                                      extra_body={"max_completion_tokens": 2, "metadata": {"ignored": True}})
    assert short.usage.completion_tokens <= 2 and expected.startswith(short.choices[0].text), short

    for call in (lambda: client.models.retrieve("not-" + name),
                 lambda: client.completions.create(model="not-" + name, prompt=prompt, max_tokens=1)):
        try:
            call()
            raise AssertionError("an unknown model was served")
        except openai.NotFoundError as e:
            assert e.code == "model_not_found", e
    check_choices(client, name, prompt, max_tokens)
    check_chat(client, name, prompt, max_tokens, chat_expected)
    check_streamed_logprobs(client, name, prompt, max_tokens)
    print(f"openai {openai.__version__}: completions, chat, streaming and models agree with kiln sample")


def check_choices(client, name, prompt, max_tokens):
    """n=2: choice i is what n=1 with seed + i answers (one prefill, each choice its own draws)."""
    sampled = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True})
    both = client.completions.create(n=2, seed=11, **sampled)
    alone = [client.completions.create(n=1, seed=11 + i, **sampled).choices[0].text for i in range(2)]
    assert [c.index for c in both.choices] == [0, 1], both
    assert [c.text for c in both.choices] == alone, (both, alone)
    texts = ["", ""]
    for chunk in client.completions.create(n=2, seed=11, stream=True, **sampled):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == alone, (texts, alone)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}], n=2, seed=11,
                                          max_tokens=max_tokens, temperature=1.0)
    chat_alone = [client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}], seed=11 + i,
                                                 max_tokens=max_tokens, temperature=1.0).choices[0].message.content
                  for i in range(2)]
    assert [c.message.content for c in chat.choices] == chat_alone, (chat, chat_alone)
    try:
        client.completions.create(model=name, prompt=prompt, max_tokens=1, n=1, best_of=2, stream=True)
        raise AssertionError("best_of with stream was accepted")
    except openai.BadRequestError as e:
        assert e.param == "best_of", e


def check_chat(client, name, prompt, max_tokens, expected):
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert whole.object == "chat.completion", whole
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == expected, (message, expected)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == expected, content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content), content
    assert whole.usage.completion_tokens == len(content), whole.usage

    roles, text, finish, usage = [], "", None, None
    stream = client.chat.completions.create(model=name, messages=messages, max_completion_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        assert usage is None, "a chunk after the usage chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert finish is None, "a chunk after the one with finish_reason"
        delta = chunk.choices[0].delta
        if delta.role is not None:
            assert text == "" and not roles, "the role after content"
            roles.append(delta.role)
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason
    assert roles == ["assistant"], roles
    assert text == expected, (text, expected)
    assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
    assert usage == whole.usage, (usage, whole.usage)

    try:
        client.chat.completions.create(model=name, messages=messages, max_tokens=1,
                                       response_format={"type": "json_object"})
        raise AssertionError("response_format json_object was accepted")
    except openai.BadRequestError as e:
        assert e.param == "response_format" and "json_object" in e.message, e


def check_streamed_logprobs(client, name, prompt, max_tokens):
    """Greedy, streamed: each chunk's logprobs are its tokens'; joined, the unstreamed answer's."""
    args = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **args):
        for key, values in joined.items():
            values.extend(getattr(chunk.choices[0].logprobs, key))
    assert joined == whole.model_dump(), (joined, whole)

    args = dict(model=name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
                logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args).choices[0].logprobs.content
    joined = []
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices[0].logprobs is not None:  # null on the role's chunk
            joined.extend(chunk.choices[0].logprobs.content)
    assert joined == whole, (joined, whole)
    assert len(whole) > 0


if __name__ == "__main__":
    main()
