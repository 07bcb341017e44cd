import re
import socket
import subprocess
import sys

import pytest
import torch

from kestrel.cli import main
from kestrel.models.loader import load_model


def test_make_model_then_generate_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "k3"
    assert main(["make-model", "--family", "kimi_k3", "--size", "tiny", "--out", str(out), "--seed", "4"]) == 0
    model, cfg = load_model(out)
    assert cfg.model_type == "kimi_k3"
    assert "wrote kimi_k3" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "Hello", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip().startswith("Hello")


def test_console_script_reports_bad_family():
    proc = subprocess.run(
        [sys.executable, "-m", "kestrel.cli", "make-model", "--family", "llama", "--out", "/tmp/x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bad_engine_flag_is_a_clean_error(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--mem-fraction", "3"]) == 2
    assert "mem_fraction" in capsys.readouterr().err


def test_engine_flags_reach_the_engine(tmp_path, capsys):
    out = tmp_path / "kl"
    main(["make-model", "--family", "kimi_linear", "--out", str(out)])
    argv = [
        "generate",
        str(out),
        "--prompt",
        "abc",
        "--max-tokens",
        "3",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "2",
    ]
    assert main(argv) == 0


def test_prefix_cache_flags_parse_and_validate(tmp_path, capsys):
    from kestrel.cli import build_parser, engine_kwargs
    from kestrel.engine.config import EngineConfig

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--no-enable-prefix-caching", "--hicache-size", "0.5"]
        + [
            "--hicache-storage-dir",
            str(tmp_path),
            "--hicache-write-policy",
            "write_back",
            "--state-track-interval",
            "64",
        ]
    )
    config = EngineConfig(**engine_kwargs(args))
    assert not config.enable_prefix_caching and config.hicache_size == 0.5
    assert config.hicache_storage_dir == str(tmp_path) and config.hicache_write_policy == "write_back"
    assert main(["generate", "--prompt", "hi", "--state-track-interval", "24"]) == 2
    assert "state_track_interval" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a listed choice: argparse refuses it before the engine
        main(["generate", "--prompt", "hi", "--hicache-write-policy", "lazy"])
    assert exit_info.value.code == 2 and "--hicache-write-policy" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["generate", "--prompt", "hi", "--hicache-storage-dir", str(blocker / "sub")]) == 2
    assert "hicache_storage_dir" in capsys.readouterr().err


def test_serve_on_a_taken_port_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), "--device", "cpu"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0 and "Traceback" not in output, output
    assert len(output.splitlines()) == 1 and str(port) in output and "in use" in output, output
    assert "serving" not in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "--prompt", "hi"]])
def test_cuda_device_without_cuda_is_a_one_line_error_before_the_model_loads(command):
    cmd = [sys.executable, "-m", "kestrel.cli", *command, "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0 and "Traceback" not in output, output
    assert len(output.splitlines()) == 1 and output.startswith("error: device: "), output


def test_serve_help_gives_every_flag_a_help_line_its_default_and_its_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))  # one entry per flag: invocation, then its help
    assert len(entries) >= 28, entries
    for entry in entries:
        invocation, *rest = re.split(r" {2,}|\n", entry.strip(), maxsplit=1)
        help_text = rest[0] if rest else ""
        assert help_text.strip(), f"no help for {invocation}"
        if invocation != "-h, --help":
            assert "default:" in help_text, f"no default shown for {invocation}"
    for choice in ("float16", "write_through_selective", "write_back", "kimi_k2", "cuda:N", "cpu"):
        assert choice in text, choice
    assert "--dtype {float32,bfloat16,float16}" in text and "--reasoning-parser {kimi,none}" in text
    assert text.split("\n\n")[1].startswith("serve a model over HTTP")  # the command's own description
