"""What a chat request may make the chat template do (issue 33): `tools` and
`chat_template_kwargs` are capped in size, and a render that runs past --chat-template-timeout
is a 400 while the server serves everyone else (a real server with tests/templates/kwarg_loops.jinja,
whose cost a kwarg sets)."""
from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from server_proc import ServerProcess

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "kwarg_loops.jinja")
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--chat-template", TEMPLATE, "--chat-template-timeout", str(TIMEOUT),
                        "--max-tools-bytes", "2KiB", "--max-chat-template-kwargs-bytes", "1KiB")
    try:
        yield srv.wait_ready()
    finally:
        srv.proc.kill()
        srv.close()


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0, **extra}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_render_past_the_timeout_is_a_400_and_a_neighbour_completes(server):
    hostile = {}

    def send_hostile():
        start = time.monotonic()
        # 10^10 loop steps: hours of rendering without the limit.
        hostile["status"], hostile["body"] = server.post_json(
            "/v1/chat/completions", chat(chat_template_kwargs={"passes": 100000}))
        hostile["seconds"] = time.monotonic() - start

    t = threading.Thread(target=send_hostile)
    t.start()
    time.sleep(0.2)
    status, neighbour = server.post_json("/v1/chat/completions", chat())
    t.join(60)
    assert status == 200 and neighbour["choices"][0]["message"]["content"]
    assert hostile["status"] == 400, hostile
    err = hostile["body"]["error"]
    assert err["param"] == "chat_template_kwargs" and "chat template" in err["message"]
    assert f"--chat-template-timeout {TIMEOUT:g}" in err["message"]
    assert hostile["seconds"] < TIMEOUT + 5  # generous: a loaded 2-core machine
    # The render stopped itself: the idle server burns no CPU on it afterwards.
    before = cpu_seconds(server.proc.pid)
    time.sleep(2.0)
    assert cpu_seconds(server.proc.pid) - before < 0.5
    status, same = server.post_json("/tokenize", {"messages": chat()["messages"],
                                                  "chat_template_kwargs": {"passes": 100000}})
    assert status == 400 and same["error"]["param"] == "chat_template_kwargs"


def test_oversized_tools_and_kwargs_are_400s_naming_the_field_and_flag(server):
    tool = {"type": "function", "function": {"name": "lookup", "description": "d" * 3000,
                                             "parameters": {"type": "object", "properties": {}}}}
    status, body = server.post_json("/v1/chat/completions", chat(tools=[tool], tool_choice="none"))
    assert status == 400 and body["error"]["param"] == "tools"
    assert "--max-tools-bytes" in body["error"]["message"] and "2048" in body["error"]["message"]
    status, body = server.post_json("/v1/chat/completions", chat(chat_template_kwargs={"note": "n" * 2000}))
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
    assert "--max-chat-template-kwargs-bytes" in body["error"]["message"] and "1024" in body["error"]["message"]
    small = dict(tool, function=dict(tool["function"], description="Looks things up."))
    status, body = server.post_json("/v1/chat/completions",
                                    chat(tools=[small], tool_choice="none", chat_template_kwargs={"passes": 2}))
    assert status == 200, body


def test_a_hostile_render_leaves_a_neighbours_token_gaps_within_2x(server):
    """Renders run on a worker thread; a hostile one (looping until its deadline) may not more than
    double a streaming neighbour's median inter-token gap while it runs. Without the throttle of
    long renders (template_sandbox.LONG_RENDER) the gap went from 5.1 to 21.2 ms here; with it 1.2-1.3x."""
    quiet = statistics.median(server.streamed_token_gaps(60))
    results = []

    def send_hostile():
        while len(results) < 50 and not done.is_set():  # renders back to back while the neighbour streams
            results.append(server.post_json("/v1/chat/completions",
                                            chat(chat_template_kwargs={"passes": 100000}))[0])

    done = threading.Event()
    t = threading.Thread(target=send_hostile)
    t.start()
    time.sleep(0.3)
    loud = statistics.median(server.streamed_token_gaps(60))
    done.set()
    t.join(60)
    print(f"neighbour's median gap: quiet {quiet * 1e3:.1f} ms, beside hostile renders {loud * 1e3:.1f} ms")
    assert results and set(results) == {400}
    assert loud < 2 * quiet, (quiet, loud)
