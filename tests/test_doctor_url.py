"""`kvshare doctor --url`, the black-box doctor, against real servers on loopback: a clean `kvshare
serve` (exit 0, exact equality from /version); one with a planted fault serving its wrong answers
(exit 1, the stage named, a repro of at most two requests that still fails replayed, and not on
the clean server); a proxy that splices one answer into a concurrent one (the canary stage);
one that adds logprob noise but never mixes (no contamination); a never-streaming one, a 401, an
unreachable URL and bad arguments (one line, exit 2); llama.cpp's llama-server (slow).

Faults: hit_before_written (multi-turn), share_without_incref, abort_ignores_refcount and
evict_held_block (abort: a timed pair, the victim streaming and the other sent after its first
chunk), no_copy_on_write (forks: sampled, seeded n=2 forks) and cached_k_one_ulp (multi-turn: the
next turn's hit one ulp off, seen only by exact equality) and lookup_ignores_adapter (the adapters
stage, on servers started with a LoRA adapter) in the default suite; slot_off_by_one,
lookup_ignores_salt and full runs against c, d and h behind `slow`. The refcount
faults (a, c, d) run unguarded under --inject-fault-unaudited (kvshare.testing.faults): kvshare's
pool would stop the engine, an engine without its guard reuses the block and mixes answers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from doctor_proxy import DoctorProxy
from helpers import bundled_path
from kvshare.cli import main
from kvshare.testing.ports import free_port
from server_proc import ServerProcess
from test_lora import bundled  # noqa: F401  (the module fixture the LoRA adapter comes from)

FAST = ["--budget", "4", "--max-tokens", "6", "--concurrency", "3"]


@pytest.fixture(scope="module")
def clean():
    srv = ServerProcess().wait_ready()
    yield srv
    srv.close()


def doctor(url: str, tmp_path, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / "report.json"
    rc = main(["doctor", "--url", url, *FAST, "--json", str(out), "--report", str(tmp_path / "report.html"),
               "--repro-out", str(tmp_path / "repro.jsonl"), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else None


def test_clean_kvshare_server_passes_every_stage_exactly(clean, tmp_path, capsys):
    t0 = time.monotonic()
    rc, report = doctor(clean.url, tmp_path)
    assert rc == 0, capsys.readouterr().out
    assert report["comparison"]["exact"] and report["capabilities"]["bit_transparent"] is True
    assert [s["name"] for s in report["stages"]] == ["noise_floor", "concurrency", "forks", "cache", "canary",
                                                     "abort", "multi_turn"]
    assert all(s["verdict"] == "clean" and s["requests"] for s in report["stages"]), report["stages"]
    assert report["capabilities"]["accepted"]["cache_salt"] and report["capabilities"]["accepted"]["seed"]
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "no contamination found" in page
    assert "<script" not in page and "<link" not in page  # self-contained
    # FAST's 4 s budget, then the first group of each stage that started after it: ~12 s on a quiet
    # machine; the bound leaves room for a 2-core box shared with other work.
    assert report["elapsed_s"] <= time.monotonic() - t0 < 150


def fault_server(fault: str) -> ServerProcess:
    return ServerProcess("--inject-fault", fault, "--inject-fault-unaudited").wait_ready()


def check_fault_found(fault: str, tmp_path, clean_url: str | None, stages: set[str], replays: bool = True,
                      only: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """The doctor's report; its repro replayed (exit 1 here, 0 on the clean server) where `replays`."""
    srv = fault_server(fault)
    try:
        assert "--inject-fault-unaudited" in srv.log_text() and "test-only" in srv.log_text()
        rc, report = doctor(srv.url, tmp_path, *(["--stages", only] if only else []), *extra)
        assert rc == 1, report and report["summary"]
        bad = {s["name"] for s in report["stages"] if s["verdict"] == "contamination"}
        assert bad & stages, (bad, report["summary"])
        repro = report["repro"]
        assert repro["stage"] in report["summary"]
        if replays:
            assert repro["requests"] <= 2 and repro["minimal"]
        assert os.path.exists(repro["curl"]) and "curl -sS" in open(repro["curl"]).read()
        if replays:
            assert main(["doctor", "--url", srv.url, "--replay", repro["path"]]) == 1  # still fails
    finally:
        srv.close()
    if clean_url is not None and replays:  # and the same requests on a sound server do not
        assert main(["doctor", "--url", clean_url, "--replay", repro["path"]]) == 0
    return report


def test_a_lookup_that_drops_the_adapter_is_found_by_the_adapters_stage_and_replays_as_a_pair(bundled, tmp_path):
    """lookup_ignores_adapter (llama.cpp #26207's bug): the server lists a LoRA adapter under the
    model (/v1/models `parent`), so the doctor sends one prompt under the base model, then under
    the adapter, on one cache_salt: the adapter's request served the base model's cached KV answers
    other than it does alone. Exit 1 from the adapters stage, a pair (base, then adapter) that
    replays; the same stage on a sound server with the same adapter finds nothing, and the pair
    replayed there does not fail."""
    lora = ("--enable-lora", "--lora-modules", f"sql={bundled['a']}")
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    clean_lora = ServerProcess(*lora).wait_ready()
    try:
        rc, report = doctor(clean_lora.url, tmp_path / "clean", "--stages", "adapters")
        assert rc == 0, report and report["summary"]
        assert report["capabilities"]["adapters"] == ["sql"]
        stage = next(s for s in report["stages"] if s["name"] == "adapters")
        assert stage["verdict"] == "clean" and len(stage["requests"]) >= 3, stage
        assert any("under sql" in r["how"] for r in stage["requests"]), stage["requests"]
        srv = ServerProcess(*lora, "--inject-fault", "lookup_ignores_adapter", "--inject-fault-unaudited").wait_ready()
        try:
            rc, report = doctor(srv.url, tmp_path / "bad", "--stages", "adapters")
            assert rc == 1, report and report["summary"]
            assert next(s for s in report["stages"] if s["name"] == "adapters")["verdict"] == "contamination"
            repro = report["repro"]
            assert repro["stage"] == "adapters" and repro["requests"] == 2 and repro["minimal"], repro
            lines = [json.loads(line) for line in open(repro["path"])]
            assert sorted(line["model"] for line in lines) == ["SmolLM2-135M-Instruct", "sql"], lines
            assert next(line for line in lines if line["victim"])["model"] == "sql"
            assert '"model": "sql"' in open(repro["curl"]).read()
            assert main(["doctor", "--url", srv.url, "--replay", repro["path"]]) == 1  # still fails
        finally:
            srv.close()
        assert main(["doctor", "--url", clean_lora.url, "--replay", repro["path"]]) == 0
    finally:
        clean_lora.close()


def check_timed_pair(repro: dict, cut: bool) -> None:
    """The repro is the victim streamed and long, the other request sent after its first chunk
    (and cut after its own first chunk, where the harm is an abort): in the JSONL and the curl
    script alike."""
    lines = [json.loads(line) for line in open(repro["path"])]
    victim = next(line for line in lines if line["victim"])
    other = next(line for line in lines if not line["victim"])
    assert victim["step"] == other["step"] and other["after_first_chunk_of"] == victim["name"], lines
    assert victim["body"]["stream"] and victim["body"]["max_tokens"] >= 32
    assert (other["cut_after_chunks"] == 1) == cut
    script = open(repro["curl"]).read()
    assert "| after_first_chunk req" in script
    assert ("awk '/^data:/" in script) == cut
    page = open(os.path.join(os.path.dirname(repro["path"]), "report.html")).read()
    assert f"sent after {victim['name']}&#x27;s first chunk" in page  # the report says the order too


def test_a_block_published_before_its_kv_is_written_is_found_by_the_next_turn(clean, tmp_path):
    """The essay's class of bug: the next turn hits a block holding a slot never written."""
    check_fault_found("hit_before_written", tmp_path, clean.url, {"multi_turn"}, only="multi_turn")


def test_a_prefix_hit_never_counted_is_found_once_its_block_is_freed_and_reused(clean, tmp_path):
    """share_without_incref, unguarded: the publisher's release frees a block a hit still reads,
    the next allocation overwrites it (vLLM's class of refcount bug, no pool guard to stop it)."""
    check_fault_found("share_without_incref", tmp_path, clean.url, {"abort"}, only="abort")


def test_forks_writing_into_their_shared_tail_block_are_found_by_sampled_seeded_forks(clean, tmp_path):
    """No copy-on-write: greedy forks write the same token in place, so only seeded sampled forks,
    each compared with its choice alone (seed + i), show it."""
    check_fault_found("no_copy_on_write", tmp_path, clean.url, {"forks"}, only="forks")


def test_an_abort_that_frees_blocks_the_victim_still_reads_shrinks_to_a_timed_pair(clean, tmp_path):
    """abort_ignores_refcount, unguarded: a cut request drops the victim's references to the prefix
    blocks they share, and the freed blocks are handed out (to the victim's next block) while the
    victim still decodes. Only the order shows it: the cut sent after the victim's first chunk,
    cut after its own first one, the victim still decoding tens of tokens later."""
    report = check_fault_found("abort_ignores_refcount", tmp_path, clean.url, {"abort"}, only="abort")
    check_timed_pair(report["repro"], cut=True)


def test_an_allocator_evicting_held_blocks_shrinks_to_a_timed_pair(clean, tmp_path):
    """evict_held_block, unguarded: a request that allocates while the victim holds cached blocks
    takes one of them and writes its own KV over it; sent after the victim's first chunk (the
    victim's blocks cached, the victim still decoding), it changes the victim's answer."""
    report = check_fault_found("evict_held_block", tmp_path, clean.url, {"abort"}, only="abort")
    check_timed_pair(report["repro"], cut=True)


def test_a_one_ulp_change_in_every_published_block_is_found_exactly_and_replays_as_a_pair(clean, tmp_path):
    """cached_k_one_ulp: every block the server publishes has one K element one ulp off, which no
    invariant sees and a tolerance hides. The server says it is bit-transparent, so the doctor
    compares exactly: the next turn (a hit on turn 1's changed blocks) differs from the same
    prompt alone on a cold salt. The change depends on the block alone, never on the cache's
    history, so the pair (turn 1, then turn 2) replays on fresh salts; the noise floor (the same
    request alone, each repeat on a fresh salt, decoding over its own changed blocks) stays exact."""
    report = check_fault_found("cached_k_one_ulp", tmp_path, clean.url, {"multi_turn"}, only="multi_turn")
    assert report["comparison"]["exact"]
    noise = next(s for s in report["stages"] if s["name"] == "noise_floor")
    assert noise["verdict"] == "clean" and "spread 0," in noise["notes"][0], noise
    # Only the logprobs move, and by less than the doctor's default tolerance elsewhere: exact
    # equality is what sees it.
    findings = next(s for s in report["stages"] if s["name"] == "multi_turn")["findings"]
    assert findings and all(f["diff"]["first_token"] is None and 0 < max(f["diff"]["drift"]) < 2e-3
                            for f in findings), [f["detail"] for f in findings]
    repro = report["repro"]
    assert repro["stage"] == "multi_turn" and repro["requests"] == 2, repro
    first, victim = (json.loads(line) for line in open(repro["path"]))
    assert [first["step"], victim["step"]] == [0, 1] and victim["victim"] and not first["victim"]
    assert first["name"].startswith("turn1") and victim["name"].startswith("turn2")
    assert first["cache_salt"] == victim["cache_salt"]  # turn 2 hits turn 1's blocks
    assert "(exact equality required)" in victim["detail"], victim["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("fault,stages,replays", [
    ("slot_off_by_one", {"concurrency", "cache", "canary", "abort", "multi_turn"}, True),
    # Every stage whose requests hit another's blocks sees it; the first finding shrinks to a
    # pair run one after the other (the publisher, then the one that hits its blocks).
    ("cached_k_one_ulp", {"concurrency", "cache", "canary", "abort", "multi_turn"}, True),
    # Same answers (identical tokens, identical KV): only the cached-token count shows the leak.
    ("lookup_ignores_salt", {"cache"}, True),
    # In a full run (the default tests run the abort stage alone): found by the first stage that
    # sees it; the repro is shrunk as far as the shrinking time allows.
    ("abort_ignores_refcount", {"abort"}, False),
    ("evict_held_block", {"concurrency", "forks", "cache", "canary", "abort", "multi_turn"}, False)])
def test_planted_faults_that_change_answers_are_found(clean, tmp_path, fault, stages, replays):
    check_fault_found(fault, tmp_path, clean.url, stages, replays)


def test_a_proxy_that_splices_concurrent_answers_is_caught_by_the_canaries(clean, tmp_path):
    proxy = DoctorProxy(clean.url, "swap")
    try:
        rc, report = doctor(proxy.url, tmp_path, "--stages", "canary")
    finally:
        proxy.close()
    assert rc == 1 and proxy.swaps > 0
    canary = next(s for s in report["stages"] if s["name"] == "canary")
    assert canary["verdict"] == "contamination"
    assert any(f["kind"] == "canary" and "canary" in f["detail"] for f in canary["findings"])
    assert report["repro"]["kind"] == "canary" and report["repro"]["requests"] == 2
    assert not report["comparison"]["exact"]  # the proxy does not pass kvshare's claim on


def test_logprob_noise_that_never_mixes_is_not_contamination(clean, tmp_path):
    proxy = DoctorProxy(clean.url, "noise")
    try:
        rc, report = doctor(proxy.url, tmp_path, "--stages", "concurrency,canary")
    finally:
        proxy.close()
    assert rc == 0, report["summary"]
    c = report["comparison"]
    assert not c["exact"] and c["tolerance"] > 0 and "noise floor" in c["why"]
    noise = report["stages"][0]
    assert "spread 0," not in noise["notes"][0]  # the noise was measured, not absent


def one_line_exit_2(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_server_that_never_streams_cannot_be_tested(clean, capsys):
    proxy = DoctorProxy(clean.url, "no_stream")
    try:
        err = one_line_exit_2(capsys, ["doctor", "--url", proxy.url, *FAST])
    finally:
        proxy.close()
    assert "never streams" in err


def test_unauthorized_unreachable_and_bad_arguments_are_one_line_exit_2(capsys):
    proxy = DoctorProxy("http://127.0.0.1:9", "auth")
    try:
        assert "401" in one_line_exit_2(capsys, ["doctor", "--url", proxy.url])
    finally:
        proxy.close()
    assert "cannot reach" in one_line_exit_2(capsys, ["doctor", "--url", f"http://127.0.0.1:{free_port()}"])
    assert "http://" in one_line_exit_2(capsys, ["doctor", "--url", "ftp://example"])
    assert "--concurrency" in one_line_exit_2(capsys, ["doctor", "--url", "http://127.0.0.1:1", "--concurrency", "0"])
    assert "--budget" in one_line_exit_2(capsys, ["doctor", "--url", "http://127.0.0.1:1", "--budget", "-1"])
    assert "bogus" in one_line_exit_2(capsys, ["doctor", "--url", "http://127.0.0.1:1", "--stages", "cache,bogus"])
    assert "--url" in one_line_exit_2(capsys, ["doctor", "--report", "x.html"])


def test_serve_refuses_the_unaudited_fault_option_without_a_fault(capsys):
    assert main(["serve", "--inject-fault-unaudited"]) == 2
    assert "needs --inject-fault FAULT" in capsys.readouterr().err


LLAMA_SERVER = os.environ.get("KVSHARE_LLAMA_SERVER", "/work/main/bench_out/llama_cpp/bin/llama-server")


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.exists(LLAMA_SERVER) or shutil.which(LLAMA_SERVER)),
                    reason=f"llama-server not built at {LLAMA_SERVER} (benchmarks/build_llama_cpp.sh; or set "
                           "KVSHARE_LLAMA_SERVER)")
def test_llama_server_runs_what_it_can_and_gives_a_verdict(tmp_path, capsys):
    port = free_port()
    log = open(tmp_path / "llama.log", "w")
    proc = subprocess.Popen([LLAMA_SERVER, "-m", bundled_path(), "--port", str(port), "-c", "2048", "-np", "4",
                             "-t", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx2

        for _ in range(240):
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        rc = main(["doctor", "--url", f"http://127.0.0.1:{port}", "--budget", "20", "--max-tokens", "8",
                   "--concurrency", "3", "--json", str(tmp_path / "r.json")])
        out = capsys.readouterr()
        print(out.out, out.err)
        report = json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").exists() else None
        assert rc in (0, 1, 2) and (report is not None or "cannot test" in out.err)
        if report is not None:
            assert report["verdict"] and report["capabilities"]["bit_transparent"] is None
            assert set(report["capabilities"]["accepted"]) == {"logprobs", "cache_salt", "seed", "ignore_eos", "n"}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
