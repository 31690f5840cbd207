"""tools/run_text_generation_server.py on a loopback port, called with the official OpenAI client and plain HTTP:
greedy tokens equal tools/generate.py's, streaming equals the whole answer, Megatron's PUT /api, bad input gets
a clear error and never a dead server, a full queue answers 429, a client that leaves mid-stream has its blocks
freed, SIGTERM drains and exits 0; then the same at tp 2 under torchrun."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from tests.data.conftest import load_tool
from tests.serving.conftest import ServerProcess, tiny_vocab

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

POOL = ["--inference-max-blocks", "15", "--inference-block-size", "4", "--inference-max-batch-size", "4",
        "--inference-max-queued", "3", "--inference-max-tokens-per-step", "32", "--drain-timeout", "20"]
ID_OF = tiny_vocab()
WORD_OF = {i: w for w, i in ID_OF.items()}
EOS = ID_OF["</s>"]


def reference(checkpoint: str, prompt: str, new: int) -> dict:
    """tools/generate.py's greedy result for ``prompt`` (in this process, tp 1)."""
    tool = load_tool("generate")
    return tool.run(tool.build_parser().parse_args(["--load", checkpoint, "--prompt", prompt, "--greedy",
                                                    "--max-new-tokens", str(new)]))


def words(ids) -> str:
    """The text of ``ids`` as the server writes it (the end-of-document token is not text)."""
    return " ".join(WORD_OF[i] for i in ids if i != EOS)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process = ServerProcess(checkpoint, flags=POOL, log_path=str(tmp_path_factory.mktemp("log") / "server.log"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.close()


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def _health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def test_openai_client_completions_and_chat_give_generate_tokens(server, checkpoint):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["ckpt"]
    prompts = ["w1 w2 w3", "w5 w6", "w40 w41 w42 w43 w44 w45 w46 w47"]
    expected = [reference(checkpoint, p, 8)["tokens"] for p in prompts]
    batch = client.completions.create(model="ckpt", prompt=prompts, max_tokens=8, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    for choice, tokens in zip(sorted(batch.choices, key=lambda c: c.index), expected):
        assert choice.text == words(tokens) and choice.finish_reason == "length"
        assert choice.logprobs.tokens == [WORD_OF[t] for t in tokens] and len(choice.logprobs.token_logprobs) == 8
    assert batch.usage.completion_tokens == 24 and batch.usage.prompt_tokens == 13
    chat_tokens = reference(checkpoint, "user w1 w2 assistant", 5)["tokens"]  # the tokenizer's chat template
    chat = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "w1 w2"}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == words(chat_tokens) and chat.choices[0].message.role == "assistant"


def test_streaming_gives_the_whole_answer_in_pieces(server, checkpoint):
    client = _client(server)
    whole = client.completions.create(model="ckpt", prompt="w7 w8", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    pieces = list(client.completions.create(model="ckpt", prompt="w7 w8", max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == whole and len(pieces) >= 10
    assert pieces[-1].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "w3"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    expected = reference(checkpoint, "user w3 assistant", 6)["tokens"]
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == words(expected)
    assert chat[-1].usage.completion_tokens == 6


def test_megatron_put_api_generates_and_scores(server, checkpoint):
    ref = reference(checkpoint, "w1 w2 w3", 8)
    tokens = ref["tokens"][:ref["tokens"].index(EOS) + 1] if EOS in ref["tokens"] else ref["tokens"]
    reply = httpx.put(server.url + "/api", json={"prompts": ["w1 w2 w3"], "tokens_to_generate": 8, "top_k": 1,
                                                 "logprobs": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == [[1, 2, 3, *tokens]] and body["segments"][0][:3] == ["w1", "w2", "w3"]
    expected = ref["prompt_logprobs"] + ref["generated_logprobs"][:len(tokens)]
    assert all(abs(a - b) < 1e-4 for a, b in zip(body["logprobs"][0], expected)) and len(body["logprobs"][0]) == len(
        expected)
    scored = httpx.put(server.url + "/api", json={"prompts": ["w1 w2 w3"], "tokens_to_generate": 0,
                                                  "logprobs": True}, timeout=60).json()
    assert scored["text"] == ["w1 w2 w3"] and len(scored["logprobs"][0]) == 2
    assert all(abs(a - b) < 1e-4 for a, b in zip(scored["logprobs"][0], ref["prompt_logprobs"]))


@pytest.mark.parametrize("path,body,status,message", [
    ("/v1/completions", b'{"prompt": "w1", "max_tokens": ', 400, "malformed JSON body"),
    ("/v1/completions", b'{"prompt": "w1", "max_tokenz": 4}', 400, "unknown field 'max_tokenz'"),
    ("/v1/completions", json.dumps({"prompt": " ".join(["w1"] * 70)}).encode(), 400,
     "maximum context length is 64 tokens, but 86 were requested"),
    ("/v1/completions", b'{"prompt": "w1", "max_tokens": 0}', 400, "max_tokens must be >= 1, got 0"),
    ("/v1/completions", b'{"prompt": "w1", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "w1", "model": "gpt-4"}', 404, "the model 'gpt-4' does not exist"),
    ("/v1/completions", b'{"prompt": "w1", "logprobs": 5}', 400, "only the chosen token's log-probability"),
    ("/v1/completions", b'{"prompt": "w1", "max_tokens": 62}', 400, "the whole pool holds 15"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'[1, 2]', 400, "Input should be a valid dictionary"),
    ("/api", b'{"prompts": ["w1"], "tokens_to_generate": 0}', 400, "tokens_to_generate=0 implies logprobs"),
])
def test_bad_input_gets_a_clear_error_and_the_server_goes_on(server, path, body, status, message):
    method = httpx.put if path == "/api" else httpx.post
    reply = method(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"], reply.text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_more_requests_than_the_pool_holds_wait_then_get_429(server):
    """Each request takes the whole pool (3 + 56 - 1 positions = 15 blocks): one runs, three wait (counting one not yet
    started), the rest 429."""
    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(server.url + "/v1/completions", json={
                "prompt": "w1 w2 w3", "max_tokens": 56, "ignore_eos": True}) for _ in range(8)])
    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 3 and 429 in codes and set(codes) <= {200, 429}, [r.text[:200] for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 56 for r in replies if r.status_code == 200)
    assert "retry later" in next(r for r in replies if r.status_code == 429).json()["error"]["message"]
    health = _health(server)
    assert health["free_blocks"] == health["total_blocks"] == 15 and health["running"] == health["waiting"] == 0


def _wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_a_client_that_leaves_mid_stream_has_its_request_aborted_and_blocks_freed(server):
    aborted = _health(server)["finished"].get("abort", 0)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
            "prompt": "w1 w2 w3", "max_tokens": 56, "stream": True, "ignore_eos": True}) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the first token arrived; then we leave
    _wait_for(lambda: _health(server)["finished"].get("abort", 0) == aborted + 1)
    health = _wait_for(lambda: (h := _health(server))["free_blocks"] == h["total_blocks"] and h)
    assert health["running"] == 0


def test_sigterm_lets_running_and_waiting_requests_finish_and_exits_0(server):
    """Last in the module: it stops the module's server. Three streams that each take the whole pool (one runs,
    two wait); SIGTERM once all are accepted and the first token came: all three finish whole, exit status 0."""
    events, accepted = {}, threading.Barrier(4, timeout=60)

    def stream(index):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "prompt": "w4", "max_tokens": 56, "stream": True, "ignore_eos": True}) as reply:
            accepted.wait()
            events[index] = [line for line in reply.iter_lines() if line.startswith("data:")]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    accepted.wait()
    assert server.terminate(timeout=60) == 0, server.output()[-3000:]
    for thread in threads:
        thread.join(timeout=60)
    for index in range(3):
        assert events[index][-1] == "data: [DONE]"
        last = json.loads(events[index][-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length", last  # drained, not cut
        assert len(events[index]) == 57
    assert "Application shutdown complete" in server.output()


def _rank0_pid(launcher_pid: int) -> int:
    """The pid of the torchrun worker with RANK=0."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if parent == launcher_pid and b"RANK=0" in environ:
            return int(pid)
    raise AssertionError(f"no RANK=0 child of {launcher_pid}")


def test_tp2_under_torchrun_serves_generate_tokens_and_stops_on_sigterm(checkpoint, tmp_path):
    expected = reference(checkpoint, "w9 w10 w11", 8)["tokens"]
    server = ServerProcess(checkpoint, nproc=2, flags=["--tensor-model-parallel-size", "2", *POOL],
                           log_path=str(tmp_path / "server.log"))
    try:
        server.wait_ready(timeout=150)
        client = _client(server)
        done = client.completions.create(model="ckpt", prompt=["w9 w10 w11", "w2"], max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert sorted(done.choices, key=lambda c: c.index)[0].text == words(expected)
        streamed = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "w9"}],
                                                  max_tokens=4, stream=True, seed=3)
        assert len([c for c in streamed if c.choices and c.choices[0].delta.content]) >= 1
        status = server.terminate(pid=_rank0_pid(server.proc.pid), timeout=90)
        assert status == 0, server.output()[-4000:]
    finally:
        server.close()
