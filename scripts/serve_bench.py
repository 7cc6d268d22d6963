#!/usr/bin/env python3
"""Serving benchmark: N concurrent streaming chat clients against an OpenAI-compatible server.

  python3 scripts/serve_bench.py --url http://127.0.0.1:8000 --clients 64 --requests 4 --json out.json

Each client sends POST /v1/chat/completions with "stream": true, one request after another
on its own kept-alive connection, for --requests requests or until --duration seconds have
passed (requests in flight then finish). Printed and written (--json) as one object:
requests, errors, output tokens and output tokens/s over the whole run, time to first token
(TTFT: request sent to the first chunk with content) and inter-token latency (ITL: gaps
between content chunks; a server that sends several tokens in one chunk shows one longer gap,
so TPOT, (latency - TTFT) / (tokens - 1) per request, is reported too), p50 and p99.

Standard library only (asyncio and raw HTTP/1.1), so it runs with any python3 on the GPU
machine, where nothing can be installed. Output tokens are the usage chunk's
completion_tokens (stream_options.include_usage), else the count of content chunks.
"""
import argparse
import asyncio
import json
import sys
import time
import urllib.parse
import urllib.request

PROMPT = "Write a long story about a king, a queen and a castle by the sea."


def percentile(values, q):
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


async def read_body(reader, headers):
    """The response body as it arrives, piece by piece (chunked, by length, or to EOF)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readline()  # the CRLF after the last chunk (no trailers sent)
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


class Client:
    def __init__(self, args, host, port, path):
        self.args, self.host, self.port, self.path = args, host, port, path
        self.conn = None

    async def request(self, body):
        """One streamed chat request: {ttft, gaps, latency, tokens} or raises."""
        data = json.dumps(body).encode()
        # A kept-alive connection the server closed after its last response (llama.cpp's server
        # does, whatever its Keep-Alive header says) answers nothing: reconnect and send again,
        # as HTTP clients' pools do; the time starts with the send that is answered.
        for fresh in (self.conn is None, True):
            if fresh:
                self.close()
                self.conn = await asyncio.open_connection(self.host, self.port)
            reader, writer = self.conn
            start = time.perf_counter()
            writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\nAccept: text/event-stream\r\n\r\n".encode() + data)
            try:
                await writer.drain()
                status_line = await reader.readline()
            except ConnectionError:
                status_line = b""
            if status_line or fresh:
                break
        status = status_line.decode().split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        # The next request opens a new connection where this one ends with the response: the
        # server said so, or the body has no length and no chunks, so only EOF ends it.
        delimited = "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"
        if headers.get("connection", "").lower() == "close" or not delimited:
            self.conn = None
        times, usage, buffer, done = [], None, b"", False
        async for piece in read_body(reader, headers):
            if len(status) < 2 or status[1] != "200":
                raise RuntimeError(f"HTTP {' '.join(status[1:])}: {piece[:200]!r}")
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.decode().removeprefix("data: ").strip()
                if payload == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter())
        if not done:
            raise RuntimeError(f"HTTP {' '.join(status[1:])}: the stream ended without [DONE]")
        if not times:
            raise RuntimeError("no content came")
        tokens = usage["completion_tokens"] if usage else len(times)
        return {"ttft": times[0] - start, "gaps": [b - a for a, b in zip(times, times[1:])],
                "latency": times[-1] - start, "tokens": tokens}

    def close(self):
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


async def run_client(args, url, model, deadline, results, errors):
    client = Client(args, url.hostname, url.port or 80, url.path.rstrip("/") + "/v1/chat/completions")
    body = {"model": model, "messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:  # every request generates max_tokens, so runs compare (vLLM's and llama.cpp's field too)
        body["ignore_eos"] = True
    done = 0
    while (args.duration and time.perf_counter() < deadline) or (not args.duration and done < args.requests):
        done += 1
        try:
            results.append(await asyncio.wait_for(client.request(body), args.timeout))
        except Exception as e:  # counted, and the connection is not reused
            errors.append(f"{type(e).__name__}: {e}"[:300])
            client.close()
    client.close()


def served_model(url):
    with urllib.request.urlopen(urllib.parse.urljoin(url.geturl(), "/v1/models"), timeout=30) as r:
        return json.load(r)["data"][0]["id"]


async def main_async(args):
    url = urllib.parse.urlparse(args.url)
    model = args.model or served_model(url)
    if args.warmup:  # one request first: lazy initialisation (graph capture, allocations) is not timed
        await run_client(argparse.Namespace(**{**vars(args), "requests": 1, "duration": 0}), url, model, 0, [], [])
    results, errors = [], []
    start = time.perf_counter()
    deadline = start + args.duration
    await asyncio.gather(*(run_client(args, url, model, deadline, results, errors) for _ in range(args.clients)))
    elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    ms = lambda xs, q: None if not xs else round(1000 * percentile(xs, q), 3)
    return {"url": args.url, "model": model, "clients": args.clients, "max_tokens": args.max_tokens,
            "requests": len(results), "errors": len(errors), "error_examples": sorted(set(errors))[:5],
            "seconds": round(elapsed, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None,
            "requests_per_s": round(len(results) / elapsed, 3) if elapsed > 0 else None,
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
            "itl_ms_p50": ms(gaps, 50), "itl_ms_p99": ms(gaps, 99),
            "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=4, help="requests per client (unless --duration)")
    p.add_argument("--duration", type=float, default=0, help="seconds to keep sending (0: --requests each)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let a request end at EOS (default: always max_tokens)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--label", help="a name recorded with the result")
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    if args.label:
        result = {"label": args.label, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    sys.exit(1 if result["errors"] or not result["requests"] else 0)


if __name__ == "__main__":
    main()
