"""The command line, run as a user would run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

KVSHARE = [sys.executable, "-m", "kvshare.cli"]


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run(KVSHARE + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def test_info_reports_the_kv_layout():
    r = _run("info", "--json", "--kv-cache-memory", "64MiB", "--dtype", "float32", "--kv-cache-dtype", "float32")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; float32 = 4 bytes.
    assert info["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert info["num_blocks"] == (64 * 2**20) // (info["kv_bytes_per_token"] * 16)
    assert info["token_slots"] == info["num_blocks"] * 16
    assert abs(info["max_len_sequences_that_fit"] - info["token_slots"] / info["max_model_len"]) < 0.01
    assert "KV cache:" in r.stderr and "bytes/token" in r.stderr  # the start-up log line


def test_info_reports_resident_weights_per_format():
    kept = json.loads(_run("info", "--json", "--kv-cache-memory", "16MiB").stdout)
    exact = json.loads(_run("info", "--json", "--kv-cache-memory", "16MiB", "--dtype", "float32",
                            "--quantization", "none").stdout)
    assert kept["quantization"] == "auto" and exact["quantization"] == "none"
    # The bundled file: 210 Q4_1 matrices, one Q8_0 embedding (tied lm_head), 61 F32 norms.
    assert kept["tensor_formats"] == exact["tensor_formats"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert sum(kept["resident_weight_bytes_by_kernel"].values()) <= kept["resident_weight_bytes"]
    assert "dense" not in kept["resident_weight_bytes_by_kernel"]
    assert set(exact["resident_weight_bytes_by_kernel"]) == {"dense"}
    # float32 dequantized: ~134.5M parameters x 4 bytes; kept quantized: under a third of that.
    assert exact["resident_weight_bytes"] > 500 * 2**20
    assert kept["resident_weight_bytes"] < exact["resident_weight_bytes"] / 3


def test_info_bfloat16_halves_bytes_per_token():
    r = _run("info", "--json", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2


def test_prefill_dtype_option_reaches_the_engine():
    """--prefill-dtype picks the dtype of dense prompt GEMMs where rows are not token rows, and with
    it the default KV cache dtype (bfloat16 under float32 activations); in the default mode prompt
    rows are token rows (issue 28), which the start-up block says instead of a GEMM dtype."""
    on = _run("info", "--json", "--kv-cache-memory", "16MiB", "--prefill-dtype", "bfloat16")
    off = _run("info", "--json", "--kv-cache-memory", "16MiB", "--prefill-dtype", "float32")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert json.loads(on.stdout)["kv_bytes_per_token"] * 2 == json.loads(off.stdout)["kv_bytes_per_token"]
    for r in (on, off):
        assert "float32 activations" in r.stderr and "prefill GEMMs" not in r.stderr
        assert "prompt linears: as decode rows" in r.stderr and "sharing: bit-transparent" in r.stderr
    bad = _run("info", "--prefill-dtype", "int8")
    assert bad.returncode == 2 and "--prefill-dtype" in bad.stderr


def test_generate_greedy_and_chat():
    r = _run("generate", "The capital of France is", "--max-tokens", "8", "--json", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8 or out["finish_reason"] == "stop"
    assert "Paris" in out["text"]
    # Not "What is the capital of France?": its first token is a near tie (tests/test_server.py, CHAT).
    r = _run("generate", "--chat", "Name the capital of France.", "--max-tokens", "24", "--json",
             "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout.strip().splitlines()[-1])["text"]


def test_bad_option_is_a_clear_error():
    r = _run("generate", "hi", "--block-size", "0")
    assert r.returncode == 2
    assert "block_size" in r.stderr
    r = _run("generate", "hi", "--model", "/no/such/model.gguf")
    assert r.returncode == 2
    assert "model" in r.stderr


def test_version_prints_the_version(capsys):
    import pytest

    import kvshare
    from kvshare.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == kvshare.__version__


def test_serve_inject_fault_needs_audit_and_stays_out_of_help(capsys):
    import pytest

    from kvshare.cli import main

    # Refused before any model loads, naming both flags.
    assert main(["serve", "--inject-fault", "x"]) == 2
    err = capsys.readouterr().err
    assert "--inject-fault" in err and "--audit" in err
    assert main(["serve", "--audit", "--inject-fault", "x"]) == 2  # with --audit: the unknown name
    assert "unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--audit" in out and "inject" not in out
