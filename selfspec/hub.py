"""Models named by their Hugging Face Hub id: `org/name`, `org/name@revision`, `org/name:file.gguf`.

huggingface_hub does the work (its cache, HF_HOME / HF_HUB_CACHE, HF_TOKEN or a saved login,
HF_HUB_OFFLINE, its progress bars); this module chooses which files a model needs and turns
the Hub's failures into one line each. Only what the runtime reads is fetched: the config,
the safetensors shards, the tokenizer and the generation config. Pickled `.bin` weights run
code when unpickled, so they are fetched only when the user opts in (allow_pickle).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub import _snapshot_download as _snapshot
from huggingface_hub import errors as E

from selfspec.errors import SelfSpecError

# the files a model directory needs besides its weights (tokenizers come in several formats)
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
SAFETENSORS_INDEX, PICKLE_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"

# org/name, each part as the Hub allows (letters, digits, '-', '_', '.'), then @revision and/or :file.gguf
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w./-]+?))?(?::(?P<file>[^:@]+\.gguf))?$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None
    filename: str | None = None  # a .gguf file inside the repo

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.filename}" if self.filename else "")


def parse(name: str) -> HubRef | None:
    """The Hub reference `name` spells, or None when it is not one (a local path wins: a
    directory `org/name` that exists is a directory)."""
    if not isinstance(name, str) or os.path.exists(os.path.expanduser(name)) or name.startswith((".", "/", "~")):
        return None
    m = _ID.match(name)
    if m is None or name.count("/") - (m["rev"] or "").count("/") - (m["file"] or "").count("/") != 1:
        return None
    return HubRef(m["repo"], m["rev"], m["file"])


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but at call time (its constants are read at import)."""
    v = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if v is None else v.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> str:
    """The Hub cache, from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def resolve(ref: HubRef, allow_pickle: bool = False, before_weights: Callable[[Path], None] | None = None) -> Path:
    """A local path for ref: the snapshot directory (downloading what is missing), or the
    .gguf file. Every failure is a SelfSpecError of one line.

    A model repo is fetched in two rounds: its small files (config, tokenizer, the weights'
    index), then exactly the weight files the index names (else `model.safetensors`), as
    transformers does: repos that also carry another copy of the weights (Mistral's
    `consolidated.safetensors`, original/ checkpoints) are not downloaded twice. Between the
    rounds, before_weights(snapshot) may refuse the model from its config (it cannot fit in
    memory), and a model whose weights cannot fit on the cache's disk is refused; the weights
    come from the commit the first round resolved the revision to, so a push in between cannot
    mix two revisions."""
    def fetch(patterns: list[str], revision: str | None) -> Path:
        return Path(snapshot_download(ref.repo_id, revision=revision, cache_dir=cache_dir(),
                                      allow_patterns=patterns, local_files_only=_offline()))

    try:
        if ref.filename:
            return Path(hf_hub_download(ref.repo_id, ref.filename, revision=ref.revision, cache_dir=cache_dir(),
                                        local_files_only=_offline()))
        small = CONFIG_FILES + TOKENIZER_FILES + [SAFETENSORS_INDEX, PICKLE_INDEX]
        path = fetch(small, ref.revision)
        commit = path.name  # a snapshot's folder is named by its commit
        if not (path / "config.json").exists():
            check_snapshot(path, ref, allow_pickle)  # not a model repo: says so before any weights download
        if before_weights is not None:
            before_weights(path)
        weights = _listed(path / SAFETENSORS_INDEX, "model.safetensors")
        check_disk(ref, commit, path, SAFETENSORS_INDEX, weights)
        path = fetch(small + weights, commit)
        if not _weights_in(path) and allow_pickle:
            weights = _listed(path / PICKLE_INDEX, "pytorch_model.bin")
            check_disk(ref, commit, path, PICKLE_INDEX, weights)
            path = fetch(small + weights, commit)
    except SelfSpecError:
        raise
    except Exception as e:
        raise SelfSpecError(explain(e, ref)) from None
    check_snapshot(path, ref, allow_pickle)
    return path


# ---- will the weights fit on disk? ------------------------------------------------------------


def check_disk(ref: HubRef, commit: str, path: Path, index_name: str, files: list[str]) -> None:
    """One line when the weight files still to download cannot fit on the cache's disk."""
    need = download_bytes(ref, commit, path, index_name, files)
    free = free_disk(Path(cache_dir()))
    if need and free is not None and need > free:
        raise SelfSpecError(f"{ref} needs {need / 1e9:.1f} GB of disk to download its weights; {free / 1e9:.1f} GB free "
                            f"in {cache_dir()}: it cannot fit (free some space, or set HF_HUB_CACHE elsewhere)")


def download_bytes(ref: HubRef, commit: str, path: Path, index_name: str, files: list[str]) -> int | None:
    """Bytes of the files not yet in the snapshot: the index's metadata.total_size when none
    is, else their sizes from the Hub's file metadata at commit; 0 offline (nothing will
    download), None when unknown."""
    missing = [f for f in files if not (path / f).exists()]
    if not missing or _offline():
        return 0
    if len(missing) == len(files):
        try:
            return int(json.loads((path / index_name).read_text())["metadata"]["total_size"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no index, or one without the total: ask the Hub
    sizes = remote_sizes(ref, commit, missing)
    return None if sizes is None else sum(sizes.values())


def remote_sizes(ref: HubRef, commit: str, files: list[str]) -> dict[str, int] | None:
    """{file: bytes} from the Hub's file metadata at commit (files it lacks are left out);
    None when the Hub cannot say (the download then reports what is wrong)."""
    try:
        infos = HfApi().get_paths_info(ref.repo_id, files, revision=commit)
    except Exception:
        return None
    return {i.path: int(i.size) for i in infos if getattr(i, "size", None) is not None}


def free_disk(where: Path) -> int | None:
    """Bytes free on the file system that holds `where` (or its nearest existing parent)."""
    for d in (where, *where.parents):
        if d.exists():
            try:
                return shutil.disk_usage(d).free
            except OSError:
                return None
    return None


def _listed(index: Path, single: str) -> list[str]:
    """The weight files an index names, else the single file's name."""
    if not index.exists():
        return [single]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise SelfSpecError(f"unreadable {index.name} in {index.parent}; download it again") from None


def _weights_in(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def check_snapshot(path: Path, ref: HubRef | str, allow_pickle: bool = False) -> None:
    """A downloaded model directory that the runtime can load: a config, and every weights
    shard its index names (an interrupted download leaves some out)."""
    if not (path / "config.json").exists():
        raise SelfSpecError(f"{ref} has no config.json: not a transformers model repository "
                            "(for a GGUF inside a repo, name the file: org/name:file.gguf)")
    for index_name in (SAFETENSORS_INDEX,) + ((PICKLE_INDEX,) if allow_pickle else ()):
        if (path / index_name).exists():
            shards = _listed(path / index_name, "")
            missing = [s for s in shards if not (path / s).exists()]
            if missing:
                raise SelfSpecError(f"{ref} is only partly downloaded: {len(missing)} of {len(shards)} weight files missing "
                                    f"({missing[0]}{', ...' if len(missing) > 1 else ''}); run again online to finish it")
    if not _weights_in(path):
        bins = any(path.glob("*.bin"))
        if bins and allow_pickle:
            return
        if bins or (not allow_pickle and _remote_has_only_pickle(path)):
            raise SelfSpecError(f"{ref} has only pickled .bin weights (unpickling can run code): pass --allow-pickle "
                                "(allow_pickle=True) to use them")
        raise SelfSpecError(f"{ref} has no .safetensors weights (the download may be incomplete; run again online)")


def _remote_has_only_pickle(path: Path) -> bool:
    """Whether the repo's file listing (kept by huggingface_hub beside the snapshot) names
    .bin weights: a snapshot without safetensors may simply be a pickle-only repo."""
    read_tree_cache = getattr(_snapshot, "read_tree_cache", None)  # private to huggingface_hub: may go away
    try:
        names = (read_tree_cache(str(path.parent.parent), path.name) if read_tree_cache else None) or {}
    except Exception:
        return False
    return any(n.endswith(".bin") for n in names) and not any(n.endswith(".safetensors") for n in names)


def explain(e: Exception, ref: HubRef) -> str:
    """One line for each way the Hub can fail us."""
    where = f"https://huggingface.co/{ref.repo_id}"
    if isinstance(e, E.GatedRepoError):
        return (f"{ref.repo_id} is gated: accept its license at {where} while logged in, then log in here "
                "(`hf auth login`, or set HF_TOKEN)")
    if isinstance(e, E.RepositoryNotFoundError):
        return (f"model not found: {ref.repo_id!r} is neither a local path nor a model on the Hub (check the name; "
                "a private repo needs `hf auth login` or HF_TOKEN)")
    if isinstance(e, getattr(E, "IncompleteSnapshotError", ())):
        return f"{ref} is only partly downloaded and the Hub cannot be reached: run again online to finish it"
    if isinstance(e, E.RevisionNotFoundError):
        return f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or commit hash)"
    if isinstance(e, E.LocalEntryNotFoundError):
        if _offline():
            return f"{ref} is not in the Hub cache ({cache_dir()}) and HF_HUB_OFFLINE is set: download it once online"
        return f"cannot reach the Hugging Face Hub to download {ref}, and it is not in the Hub cache ({cache_dir()})"
    if isinstance(e, (E.EntryNotFoundError, getattr(E, "RemoteEntryNotFoundError", E.EntryNotFoundError))):
        return f"{ref.repo_id} has no file {ref.filename or 'config.json'!r}" + (f" at revision {ref.revision}" if ref.revision else "")
    if isinstance(e, E.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            return f"{ref.repo_id}: the Hub refused the credentials (401): log in again (`hf auth login`) or fix HF_TOKEN"
        return f"the Hub failed to serve {ref}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if isinstance(e, E.HFValidationError):
        return f"not a valid Hub model id: {ref}"
    if isinstance(e, OSError):
        return f"cannot download {ref}: {e.strerror or e}"
    return f"cannot download {ref}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def repo_id_of(path: str | os.PathLike) -> str | None:
    """The repo id of a Hub cache snapshot path (.../models--org--name/snapshots/<commit>[/file]), else None."""
    for part in Path(path).resolve().parts[::-1]:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/", 1)
    return None


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of repo_id's main revision (or its newest one), without any network."""
    root = Path(cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / "main"
    try:
        snap = root / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    except OSError:
        pass
    snaps = sorted((p for p in (root / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def cached_bytes(repo_id: str) -> int:
    """Bytes of repo_id's weights in the Hub cache (0 when none)."""
    snap = cached_snapshot(repo_id)
    if snap is None:
        return 0
    return sum(p.stat().st_size for p in snap.glob("*.safetensors") if p.exists())


def local_config(ref: HubRef) -> Path | None:
    """The cached config.json of ref (no network), or None."""
    if ref.filename:
        return None
    try:
        p = try_to_load_from_cache(ref.repo_id, "config.json", cache_dir=cache_dir(), revision=ref.revision)
    except Exception:
        return None
    return Path(p) if isinstance(p, str) else None
