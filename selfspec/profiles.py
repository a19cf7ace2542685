"""Draft profiles: a saved DraftConfig plus the fingerprint of the model it was made for.

Search and training write them; generate/bench/serve read them with --profile. Writes are
atomic (temporary file, then rename) so a crash never leaves half a profile.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.loading import cache_root, repo_id

FORMAT = "selfspec-profile/1"


@dataclass
class Profile:
    draft: DraftConfig
    model_fingerprint: str
    model_name: str = ""
    metrics: dict = field(default_factory=dict)  # e.g. measured speedup, acceptance
    _: KW_ONLY  # the optional parts below are named (older profiles have none of them)
    # Hub repo ids the profile is for, whatever their weights' fingerprint (the built-in profiles
    # of published checkpoints, made before their weights were seen here): see installed_profile
    model_ids: tuple[str, ...] = ()
    model: dict = field(default_factory=dict)  # what a built-in profile knows of its checkpoint (shape, size)
    # Optional: each strategy's best measured options for this model, what a strategy named
    # without options starts from (best_options): {strategy: {"options": {...}, "metrics": {...}}}.
    # Older profiles have none; readers that predate it ignore it.
    strategies: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {
            "format": FORMAT,
            "model_fingerprint": self.model_fingerprint,
            "model_name": self.model_name,
            "draft": self.draft.to_dict(),
            "metrics": self.metrics,
        }
        if self.model_ids:
            d["model_ids"] = list(self.model_ids)
        if self.model:
            d["model"] = self.model
        if self.strategies:
            d["strategies"] = self.strategies
        return d

    def fits(self, fingerprint: str, repo_id: str | None = None) -> bool:
        """Whether the profile was made for this model: its fingerprint, or its Hub repo."""
        return bool(fingerprint) and self.model_fingerprint == fingerprint or bool(repo_id) and repo_id in self.model_ids


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file.
    The file gets the mode any new file gets (0666 less the umask, so 0644 usually), not
    mkstemp's private 0600: these are results and profiles, meant to be shared and served."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    atomic_write_text(path, json.dumps(profile.to_dict(), indent=2) + "\n")


def load_profile(path: str | os.PathLike, fingerprint: str | None = None, repo_id: str | None = None) -> Profile:
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise SelfSpecError(f"profile not found: {path}") from e
    except (OSError, json.JSONDecodeError) as e:
        raise SelfSpecError(f"cannot read profile {path}: {e}") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT or "draft" not in d:
        raise SelfSpecError(f"{path} is not a selfspec draft profile (expected format {FORMAT})")
    ids = d.get("model_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise SelfSpecError(f"{path}: model_ids must be a list of Hub repo ids")
    if fingerprint is not None and d.get("model_fingerprint") != fingerprint and not (repo_id and repo_id in ids):
        raise SelfSpecError(
            f"profile {path} was made for another model (fingerprint {d.get('model_fingerprint')}, this model is {fingerprint})"
        )
    draft_d = dict(d["draft"])
    for cfg_d in (draft_d, draft_d.get("base") or {}):
        if cfg_d.get("adapter") and not Path(cfg_d["adapter"]).is_absolute():
            cfg_d["adapter"] = str((Path(path).parent / cfg_d["adapter"]).resolve())
    try:
        draft = DraftConfig.from_dict(draft_d)
    except TypeError as e:
        raise SelfSpecError(f"bad draft options in {path}: {e}") from e
    strategies = copy.deepcopy(d.get("strategies") or {})
    for name, entry in strategies.items() if isinstance(strategies, dict) else [(None, None)]:
        options = entry.get("options") if isinstance(entry, dict) else None
        if isinstance(options, dict) and options.get("adapter") and not Path(options["adapter"]).is_absolute():
            options["adapter"] = str((Path(path).parent / options["adapter"]).resolve())
        if not isinstance(options, dict) or name in ("auto", "autoregressive"):
            raise SelfSpecError(f"bad strategies entry {name!r} in {path}: expected {{\"options\": {{...}}, \"metrics\": {{...}}}}")
        try:
            DraftConfig.from_dict({**options, "strategy": name})
        except (SelfSpecError, TypeError) as e:
            raise SelfSpecError(f"bad options for {name} in {path}: {e}") from e
    model = d.get("model") if isinstance(d.get("model"), dict) else {}
    return Profile(draft, d.get("model_fingerprint", ""), d.get("model_name", ""), d.get("metrics", {}), model_ids=tuple(ids),
                   model=model, strategies=strategies)


# ---- profiles that lose -------------------------------------------------------------------
# A tool that measured its best setting slower than plain decoding still writes it (it is a
# result), marked `slower_than_autoregressive`; auto never adopts such a profile and
# `install` refuses it. Profiles written before the mark are judged by their measured speedup.


def measured_speedup(profile: Profile) -> float | None:
    """The speedup over autoregressive decoding its maker measured (None: not measured)."""
    m = profile.metrics or {}
    for key in ("speedup_vs_autoregressive", "measured_speedup"):
        if isinstance(m.get(key), (int, float)):
            return float(m[key])
    if m.get("source") == "selfspec sweep" and isinstance(m.get("speedup"), (int, float)):
        return float(m["speedup"])
    return None


def loses(profile: Profile) -> bool:
    """Whether the profile was measured slower than autoregressive decoding."""
    flag = (profile.metrics or {}).get("slower_than_autoregressive")
    if isinstance(flag, bool):
        return flag
    x = measured_speedup(profile)
    return x is not None and x < 1.0


def losing_note(profile: Profile) -> str | None:
    """One line saying that the profile loses to plain decoding, or None."""
    if not loses(profile):
        return None
    x = measured_speedup(profile)
    how = f"measured {x:.2f}x of autoregressive speed" if x is not None else "measured slower than autoregressive"
    src = (profile.metrics or {}).get("source")
    return (f"this profile ({profile.draft.strategy}) {how}{f' by {src}' if src else ''}: it is SLOWER than plain decoding; "
            "--strategy auto will not adopt it as the model's profile")


PACKAGED = Path(__file__).parent / "data" / "profiles"  # searched profiles shipped with selfspec
_log = logging.getLogger("selfspec")
_skipped: set[str] = set()  # losing installed profiles already reported


def user_profile_dir() -> Path:
    return cache_root() / "profiles"


_read: dict[Path, tuple[tuple[int, int, int], Profile | None]] = {}  # path -> ((inode, mtime_ns, size), its profile or None)


def _read_profile(path: Path) -> Profile | None:
    """load_profile(path), or None for a file that is not a usable profile; parsed again only
    when the file changes (a server builds auto's drafter per request: reading and validating
    every profile was a visible part of each admission). install_profile writes a new file and
    renames it over the old one: a new inode, so a change is never missed."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    hit = _read.get(path)
    if hit is None or hit[0] != key:
        try:
            prof = load_profile(path)
        except SelfSpecError:
            prof = None
        hit = _read[path] = (key, prof)
    return hit[1]  # shared: never changed here


def installed_profile(fingerprint: str, shared: bool = False, repo_id: str | None = None) -> Profile | None:
    """The profile `auto` uses for a model: the user's (selfspec search --install) first,
    then one shipped in the package; None when none matches. A profile matches by the model's
    fingerprint first; then, for a model that came from the Hub (repo_id), or whose weights
    were seen before under a repo id (remembered_repo), by the profile's model_ids: the
    built-in profiles of published checkpoints. The caller gets its own copy, or with
    shared=True the parsed one that every caller shares (read only: auto's drafter, built per
    request, reads it)."""
    repo_id = repo_id or remembered_repo(fingerprint)
    for match in ("fingerprint", "repo"):
        if match == "repo" and not repo_id:
            break
        for d in (user_profile_dir(), PACKAGED):
            for path in sorted(d.glob("*.json")) if d.is_dir() else ():
                prof = _read_profile(path)
                if prof is None:
                    continue
                if (prof.model_fingerprint != fingerprint) if match == "fingerprint" else (repo_id not in prof.model_ids):
                    continue
                if loses(prof):
                    if str(path) not in _skipped:
                        _skipped.add(str(path))
                        _log.warning(f"selfspec: warning: auto ignores the installed profile {path}: {losing_note(prof)}")
                    continue
                return prof if shared else replace(prof, metrics=copy.deepcopy(prof.metrics))
    return None


def builtin_profiles() -> list[Profile]:
    """The shipped profiles of published checkpoints (those keyed by Hub repo ids), by name."""
    out = [p for p in (_read_profile(f) for f in sorted(PACKAGED.glob("*.json"))) if p is not None and p.model_ids]
    return sorted(out, key=lambda p: p.model_ids[0].lower())


def checkpoint_repo(name: str, spec) -> str | None:
    """The Hub repo a model came from: its Hub id, its path in the Hub cache, or a local copy
    (`hf download --local-dir DIR`) whose directory is named after a checkpoint with a built-in
    profile and has that checkpoint's shape. (A copy renamed and never loaded by its id is
    recognised by its weights' fingerprint instead: remembered_repo.)"""
    rid = repo_id(name)
    if rid is not None or not os.path.isdir(os.path.expanduser(name)):
        return rid
    base = os.path.basename(os.path.normpath(os.path.expanduser(name))).lower()
    for prof in builtin_profiles():
        m = prof.model
        shape = (m.get("num_layers"), m.get("hidden_size"), m.get("vocab_size"))
        if any(i.split("/")[-1].lower() == base for i in prof.model_ids) and shape == (spec.num_layers, spec.hidden_size, spec.vocab_size):
            return prof.model_ids[0]
    return None


# ---- weights seen under a repo id -----------------------------------------------------------
# A local copy of a Hub model (saved elsewhere, or moved out of the Hub cache) has no repo id to
# go by; its weights' fingerprint does. Each model loaded by a repo id that has a built-in
# profile is remembered here, so its copies get the same profile.

_REPOS_FILE = "fingerprint-repos.json"
_repos_cache: tuple[Path, dict] | None = None  # (the file, what it holds)


def _repos_path() -> Path:
    return cache_root() / _REPOS_FILE


def _read_repos() -> dict:
    global _repos_cache
    path = _repos_path()
    if _repos_cache is None or _repos_cache[0] != path:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            d = {}
        _repos_cache = (path, d if isinstance(d, dict) else {})
    return _repos_cache[1]


def remembered_repo(fingerprint: str) -> str | None:
    """The repo id weights with this fingerprint were loaded under before, if any."""
    r = _read_repos().get(fingerprint) if fingerprint else None
    return r if isinstance(r, str) else None


def remember_repo(fingerprint: str, repo_id: str) -> None:
    """Note that these weights came from repo_id (written atomically; a failure to write is not fatal)."""
    global _repos_cache
    repos = dict(_read_repos())
    if not fingerprint or repos.get(fingerprint) == repo_id:
        return
    repos[fingerprint] = repo_id
    try:
        atomic_write_text(_repos_path(), json.dumps(repos, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        _log.warning(f"selfspec: note: could not remember the repo of {fingerprint} ({e})")
    _repos_cache = (_repos_path(), repos)


def best_options(fingerprint: str, strategy: str, repo_id: str | None = None) -> tuple[dict, str] | None:
    """(options, where from) that `strategy`, named without options, starts from on this model:
    the first profile for it (the user's installed ones, then those shipped) that measured the
    strategy, either in its `strategies` map or as its own draft. A profile whose own draft
    loses to plain decoding still counts here: its other entries are measurements too, and a
    user who names a strategy gets that strategy at its best. A profile matches by fingerprint or,
    for the built-in ones of published checkpoints, by repo id (given, or remembered for these
    weights). None: no profile measured it."""
    repo_id = repo_id or remembered_repo(fingerprint)
    for d in (user_profile_dir(), PACKAGED):
        for path in sorted(d.glob("*.json")) if d.is_dir() else ():
            prof = _read_profile(path)
            if prof is None or not prof.fits(fingerprint, repo_id):
                continue
            if strategy in prof.strategies:
                return copy.deepcopy(prof.strategies[strategy]["options"]), str(path)
            own = prof.draft.base if prof.draft.strategy == "auto" else prof.draft
            if own is not None and own.strategy == strategy:
                return own.explicit_options(), str(path)
    return None


def install_profile(profile: Profile) -> Path:
    """Make `profile` the one `--strategy auto` uses for its model. A profile measured slower
    than plain decoding is refused."""
    if loses(profile):
        raise SelfSpecError(f"not installed: {losing_note(profile)}")
    path = user_profile_dir() / f"{profile.model_fingerprint}.json"
    save_profile(profile, path)
    return path
