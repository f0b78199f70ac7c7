"""Third-party import noise (torchao's "Failed to load" of its CUDA kernels, torch's _pytree
Enum deprecation) goes to the log file, not the terminal; every other record, from those
libraries or from the user's own code, still shows."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from trainprobes.quiet import third_party_noise_to_log


def test_only_the_named_noise_is_moved_to_the_log(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level(logging.WARNING), third_party_noise_to_log():
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'K'>")
        logging.getLogger("torchao").warning("a real torchao warning about your model")
        logging.getLogger("mypkg").warning("Failed to load my own data")
    shown = [r.getMessage() for r in caplog.records]
    assert shown == ["a real torchao warning about your model", "Failed to load my own data"]
    log, = (tmp_path / "trainprobes-logs").glob("third-party-*.log")
    text = log.read_text()
    assert "_C_mxfp8.so" in text and "<enum 'K'> is an Enum subclass" in text
    logging.getLogger("torchao").warning("Failed to load after the command")   # the filter is gone
    assert caplog.records[-1].getMessage() == "Failed to load after the command"


@pytest.mark.slow
def test_a_transformers_backed_command_prints_nothing_from_torchao_or_torch_internals():
    pytest.importorskip("transformers")
    p = subprocess.run([sys.executable, "-m", "trainprobes", "zoo", "--model", "llama", "--probes", "batch",
                        "--no-progress"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "default"})
    assert p.returncode == 0, p.stderr[-2000:]
    for noise in ("Failed to load", "_pytree", "register_constant", "torchao"):
        assert noise not in p.stderr, p.stderr[-2000:]
