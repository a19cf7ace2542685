"""Models named by their Hub id, and loading at size, without a network.

A Hub cache is laid out by the tests themselves (blobs, refs/<revision>, snapshots/<commit>
with links, as huggingface_hub writes it) and read through HF_HUB_CACHE with HF_HUB_OFFLINE=1;
the Hub's failures (gated, missing, unreachable) are its own exception types, raised by a
stand-in for the download. The loader's memory is measured in a subprocess on a generated
checkpoint of ~300 MB.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import gguf
import pytest
import torch
from huggingface_hub import errors as hub_errors

try:  # the HTTP client huggingface_hub's errors carry a response of (httpx2 from its 2.x)
    import httpx2 as http
except ImportError:  # pragma: no cover
    import httpx as http

import helpers
from gguf_files import transformers_model, write_gguf
import selfspec
from selfspec import cli, hub, loading
from selfspec.errors import SelfSpecError
from selfspec.profiles import installed_profile

COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20
PROMPT = "the cat sat on the mat and"


def lay_out(cache: Path, repo_id: str, commit: str, src: Path, refs=("main",), skip=()) -> Path:
    """src's files as snapshot `commit` of repo_id in a Hub cache: content-addressed blobs,
    the snapshot's entries linked to them, refs naming the commit. -> the snapshot dir."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name in skip:
            continue
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir(exist_ok=True)
    for r in refs:
        (root / "refs" / r).write_text(commit)
    return snap


def tiny_dir(tmp: Path, seed: int, num_layers: int = 4) -> tuple[Path, object]:
    """A tiny Llama saved as transformers saves one (safetensors + tokenizer). -> (dir, hf model)"""
    d = tmp / f"tiny-{seed}-{num_layers}"
    hf = helpers.build_hf("llama", seed=seed, num_layers=num_layers)
    hf.save_pretrained(d)
    helpers.word_tokenizer().save_pretrained(d)
    return d, hf


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "selfspec-cache"))  # remembered repos stay here
    return cache


def tokens(model) -> list[int]:
    return helpers.ar_generate(model, PROMPT, max_new_tokens=8).token_ids


# ---- ids ---------------------------------------------------------------------------------------


def test_parse_hub_ids(tmp_path, monkeypatch):
    assert hub.parse("org/name") == hub.HubRef("org/name")
    assert hub.parse("org/name@v1.0") == hub.HubRef("org/name", "v1.0")
    assert hub.parse("org/na.me-x_y:model.Q4_K_M.gguf") == hub.HubRef("org/na.me-x_y", None, "model.Q4_K_M.gguf")
    assert hub.parse("org/name@refs/pr/1:sub/dir/f.gguf") == hub.HubRef("org/name", "refs/pr/1", "sub/dir/f.gguf")
    for not_an_id in ("gemma-3-270m", "a/b/c", "./org/name", "/abs/path", "org/", "/name", "org/name:file.bin"):
        assert hub.parse(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse("org/name") is None  # a directory that exists is a directory
    assert str(hub.parse("org/x@main:f.gguf")) == "org/x@main:f.gguf"


def test_repo_id_of_a_cache_path(hub_cache, tmp_path):
    src, _ = tiny_dir(tmp_path, 0)
    snap = lay_out(hub_cache, "test-org/tiny", COMMIT_A, src)
    assert hub.repo_id_of(snap) == "test-org/tiny"
    assert hub.repo_id_of(snap / "config.json") == "test-org/tiny"
    assert hub.repo_id_of(tmp_path) is None


# ---- loading by id, offline ----------------------------------------------------------------------


def test_load_by_id_at_a_revision_and_a_commit(hub_cache, tmp_path):
    src_a, hf_a = tiny_dir(tmp_path, 0)
    src_b, hf_b = tiny_dir(tmp_path, 1)
    lay_out(hub_cache, "test-org/tiny", COMMIT_A, src_a, refs=("main",))
    lay_out(hub_cache, "test-org/tiny", COMMIT_B, src_b, refs=("v2",))
    a, b = selfspec.load(hf_a, tokenizer=helpers.word_tokenizer()), selfspec.load(hf_b, tokenizer=helpers.word_tokenizer())
    m = selfspec.load("test-org/tiny")
    assert (m.name, m.repo_id, m.fingerprint) == ("test-org/tiny", "test-org/tiny", a.fingerprint)
    assert tokens(m) == tokens(a)
    assert selfspec.load("test-org/tiny@v2").fingerprint == b.fingerprint
    assert selfspec.load(f"test-org/tiny@{COMMIT_A}").fingerprint == a.fingerprint
    assert m.tokenizer is not None and m.tokenizer.decode(m.encode("the cat")) == "the cat"


def test_a_gguf_inside_a_repo_is_downloaded_and_read(hub_cache, tmp_path):
    (tmp_path / "g").mkdir()
    hf = helpers.build_hf("llama", seed=2)
    write_gguf(hf, tmp_path / "g" / "tiny.Q8_0.gguf", gguf.GGMLQuantizationType.F32)
    snap = lay_out(hub_cache, "test-org/tiny-GGUF", COMMIT_A, tmp_path / "g")
    m = selfspec.load("test-org/tiny-GGUF:tiny.Q8_0.gguf", tokenizer=helpers.word_tokenizer())
    assert (snap / "tiny.Q8_0.gguf").exists() and m.name == "test-org/tiny-GGUF:tiny.Q8_0.gguf"
    assert m.fingerprint == selfspec.load(transformers_model(snap / "tiny.Q8_0.gguf")).fingerprint
    with pytest.raises(SelfSpecError, match="not in the Hub cache"):
        selfspec.load("test-org/tiny-GGUF:other.gguf")


def test_the_command_line_takes_an_id_offline(hub_cache, tmp_path):
    src, hf = tiny_dir(tmp_path, 0)
    lay_out(hub_cache, "test-org/tiny", COMMIT_A, src)
    env = {**os.environ, "SELFSPEC_TEST_THREADS": "1"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "selfspec", *a], env=env, capture_output=True, text=True, timeout=300)
    ok = run("generate", "--model", "test-org/tiny", PROMPT, "--max-new-tokens", "8", "--strategy", "autoregressive", "--json")
    assert ok.returncode == 0, ok.stderr
    ref = selfspec.load(hf, tokenizer=helpers.word_tokenizer())
    assert json.loads(ok.stdout)["token_ids"] == tokens(ref)
    missing = run("generate", "--model", "test-org/absent", "hi")
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "not in the Hub cache" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


# ---- the Hub's failures: one line each -------------------------------------------------------------


def _hub_raises(monkeypatch, exc):
    def download(*a, **k):
        raise exc
    monkeypatch.setattr(hub, "snapshot_download", download)


def _response(status: int):
    return http.Response(status, request=http.Request("GET", "https://huggingface.co/api/models/x"))


@pytest.mark.parametrize("exc, expect", [
    (hub_errors.GatedRepoError("403 gated", response=_response(403)), "is gated: accept its license at https://huggingface.co/facebook/layerskip-llama2-7B"),
    (hub_errors.RepositoryNotFoundError("404", response=_response(404)), "model not found: 'facebook/layerskip-llama2-7B' is neither"),
    (hub_errors.RevisionNotFoundError("404 rev", response=_response(404)), "has no revision"),
    (hub_errors.LocalEntryNotFoundError("connection error"), "cannot reach the Hugging Face Hub"),
    (hub_errors.HfHubHTTPError("401 Unauthorized", response=_response(401)), "refused the credentials"),
])
def test_hub_failures_are_one_line(monkeypatch, capsys, exc, expect):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    _hub_raises(monkeypatch, exc)
    with pytest.raises(SelfSpecError, match=expect.replace(".", r"\.").replace("(", r"\(")):
        selfspec.load("facebook/layerskip-llama2-7B@v1" if "revision" in expect else "facebook/layerskip-llama2-7B")
    assert cli.main(["generate", "--model", "facebook/layerskip-llama2-7B", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfspec: error: ")


def test_a_half_downloaded_snapshot_is_one_line(hub_cache, tmp_path):
    d = tmp_path / "sharded"
    helpers.write_llama_checkpoint(d, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=96, tied=False,
                                   shard_bytes=40_000)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) >= 2
    lay_out(hub_cache, "test-org/sharded", COMMIT_A, d, skip=(shards[-1],))
    with pytest.raises(SelfSpecError, match=r"only partly downloaded: 1 of \d+ weight files missing"):
        selfspec.load("test-org/sharded")
    # the same directory used as a path says what is missing too
    shutil.copytree(d, tmp_path / "copy")
    (tmp_path / "copy" / shards[0]).unlink()
    with pytest.raises(SelfSpecError, match="is incomplete: 1 of"):
        selfspec.load(str(tmp_path / "copy"))


def test_pickled_weights_only_with_consent(hub_cache, tmp_path):
    src, hf = tiny_dir(tmp_path, 0)
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, pkl / f.name)
    torch.save(hf.state_dict(), pkl / "pytorch_model.bin")
    lay_out(hub_cache, "test-org/pickled", COMMIT_A, pkl)
    with pytest.raises(SelfSpecError, match="only pickled .bin weights .* --allow-pickle"):
        selfspec.load("test-org/pickled")
    with pytest.raises(SelfSpecError, match="--allow-pickle"):
        selfspec.load(str(pkl))
    m = selfspec.load("test-org/pickled", allow_pickle=True)
    assert m.fingerprint == selfspec.load(hf).fingerprint


def test_a_model_that_cannot_fit_is_refused_before_reading(tmp_path, monkeypatch):
    src, _ = tiny_dir(tmp_path, 0)
    monkeypatch.setattr(loading.Checkpoint, "__getitem__", lambda *a: pytest.fail("read a weight"))
    monkeypatch.setattr(loading, "available_memory", lambda device="cpu": 1000)
    with pytest.raises(SelfSpecError, match=r"needs [\d.]+ GB for its weights; [\d.]+ GB of memory available on this machine: it cannot fit"):
        selfspec.load(str(src))


def test_runtime_bytes_counts_the_weights(zoo):
    for arch in ("llama", "llama3", "gemma3"):
        hf, m = zoo.get(arch)
        params = sum(p.numel() for n, p in hf.named_parameters() if p.dim() == 2)  # matrices (norms, biases: noise)
        assert loading.runtime_bytes(m.spec, torch.float32) == 4 * params, arch
        held = m.memory()  # as laid out: 64-column tiles pad a little
        assert 4 * params <= held["weights"] <= 1.5 * 4 * params + 4 * 64 * 64 * 4 * m.spec.num_layers, (arch, held)


# ---- the seeds' checkpoints: their built-in profiles -------------------------------------------------


def test_a_layerskip_checkpoint_gets_its_profile_by_id_and_by_its_weights(hub_cache, tmp_path):
    src, hf = tiny_dir(tmp_path, 0, num_layers=6)  # exit layer 4 of 6
    lay_out(hub_cache, "facebook/layerskip-llama3.2-1B", COMMIT_A, src)
    m = selfspec.load("facebook/layerskip-llama3.2-1B")
    prof = installed_profile(m.fingerprint, repo_id=m.repo_id)
    assert prof is not None and prof.model_ids == ("facebook/layerskip-llama3.2-1B",)
    assert (prof.draft.strategy, prof.draft.exit_layer, prof.draft.num_speculations) == ("early-exit", 4, 6)
    out = m.generate(PROMPT, max_new_tokens=16, strategy="auto")
    assert out.stats.draft["source"] == "profile" and out.stats.draft["draft"]["exit_layer"] == 4
    assert out.token_ids == helpers.ar_generate(m, PROMPT, max_new_tokens=16).token_ids
    # a copy elsewhere, under another name: recognised by its weights, seen under the id before
    copy = tmp_path / "my-model"
    shutil.copytree(src, copy)
    c = selfspec.load(str(copy))
    assert c.repo_id is None and installed_profile(c.fingerprint) is not None
    # another model gets none
    other, _ = tiny_dir(tmp_path, 5, num_layers=6)
    assert installed_profile(selfspec.load(str(other)).fingerprint) is None


def test_models_lists_the_collection(hub_cache, tmp_path, capsys):
    src, _ = tiny_dir(tmp_path, 0)
    lay_out(hub_cache, "facebook/layerskip-llama2-7B", COMMIT_A, src)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for rid in ("facebook/layerskip-llama2-7B", "facebook/layerskip-llama2-13B", "facebook/layerskip-llama2-70B",
                "facebook/layerskip-codellama-7B", "facebook/layerskip-codellama-34B", "facebook/layerskip-llama3-8B",
                "facebook/layerskip-llama3.2-1B"):
        assert rid in out
    line = next(ln for ln in out.splitlines() if "facebook/layerskip-llama2-7B " in ln)
    assert "6.7B 13.5 GB" in line and "exit 4/32, K=6" in line and " no " not in line  # cached (a stand-in)


# ---- memory at load ------------------------------------------------------------------------------------

_PEAK = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    import selfspec, transformers.models.llama.modeling_llama  # imports before the window
    from selfspec import kernels
    from selfspec.architectures import ModelSpec
    from selfspec.loading import load_source
    from selfspec.runtime import Runtime
    kernels.available()

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))

    sd, config, _, _ = load_source(sys.argv[1])
    spec = ModelSpec.from_hf_config(config)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
    base = status("VmRSS:")
    rt = Runtime.from_state_dict(spec, sd, config, getattr(torch, sys.argv[2]), "cpu")
    weights = rt.weight_bytes() + (0 if rt.embed_weight is None else rt.embed_weight.numel() * rt.embed_weight.element_size())
    print(json.dumps({"peak": status("VmHWM:") - base, "weights": weights}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_loader_holds_no_second_copy(tmp_path, dtype):
    """~300 MB of bf16 shards into the runtime's layout: the loader's peak is the runtime's
    bytes plus chunks in flight (it was 2.4x: the state dict, the transposed copy, the packed one)."""
    d = tmp_path / "ckpt"
    helpers.write_llama_checkpoint(d, hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000,
                                   tied=False, shard_bytes=150 << 20)
    out = subprocess.run([sys.executable, "-c", _PEAK, str(d), dtype], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SELFSPEC_TEST_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["weights"] > (280 << 20) * (2 if dtype == "float32" else 1)
    assert r["peak"] <= 1.15 * r["weights"], f"peak {r['peak'] / 2**20:.0f} MiB for {r['weights'] / 2**20:.0f} MiB of weights"


def test_only_the_weights_the_index_names_are_fetched(hub_cache, tmp_path, monkeypatch):
    """Repos that also carry another copy of the weights (Mistral's consolidated.safetensors)
    must not be downloaded twice: the second round asks for the index's shards only."""
    d = tmp_path / "sharded"
    helpers.write_llama_checkpoint(d, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=96, tied=False,
                                   shard_bytes=40_000)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    shutil.copy(d / shards[0], d / "consolidated.safetensors")
    snap = lay_out(hub_cache, "test-org/two-copies", COMMIT_A, d)
    asked = []
    real = hub.snapshot_download

    def download(repo_id, **kw):
        asked.append(kw["allow_patterns"])
        return real(repo_id, **kw)

    monkeypatch.setattr(hub, "snapshot_download", download)
    assert hub.resolve(hub.HubRef("test-org/two-copies")) == snap
    weights = [p for p in asked[-1] if p.endswith(".safetensors")]
    assert weights == shards and not any("*" in p for p in asked[-1])


# ---- before the weights download: fit, one commit ---------------------------------------------------


def recording_download(monkeypatch, after_first=lambda: None) -> list:
    """huggingface_hub's download, each call's (revision, allow_patterns) kept; after_first runs
    between the first round and the next."""
    asked, real = [], hub.snapshot_download

    def download(repo_id, **kw):
        asked.append((kw["revision"], kw["allow_patterns"]))
        path = real(repo_id, **kw)
        if len(asked) == 1:
            after_first()
        return path

    monkeypatch.setattr(hub, "snapshot_download", download)
    return asked


def test_a_hub_model_that_cannot_fit_is_refused_before_its_weights_download(hub_cache, tmp_path, monkeypatch, capsys):
    src, _ = tiny_dir(tmp_path, 0)
    lay_out(hub_cache, "test-org/tiny", COMMIT_A, src)
    asked = recording_download(monkeypatch)
    monkeypatch.setattr(loading, "available_memory", lambda device="cpu": 1000)
    with pytest.raises(SelfSpecError, match=r"test-org/tiny in float32 needs [\d.]+ GB for its weights; [\d.]+ GB of memory available"):
        selfspec.load("test-org/tiny", dtype="float32")
    assert len(asked) == 1 and not any(p.endswith((".safetensors", ".bin")) for p in asked[0][1])  # config, index, tokenizer
    capsys.readouterr()
    assert cli.main(["generate", "--model", "test-org/tiny", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it cannot fit" in err


def _online_without_weights(hub_cache, tmp_path, monkeypatch, index: bool) -> tuple[Path, list[str], int]:
    """A sharded model whose small files only are in the cache, the Hub 'online' behind a stand-in
    that serves the first round and fails the test if weights are asked for. -> (snapshot, shards, total_size)"""
    d = tmp_path / "sharded"
    total = helpers.write_llama_checkpoint(d, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=96, tied=False,
                                           shard_bytes=40_000)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    if not index:
        doc = json.loads((d / hub.SAFETENSORS_INDEX).read_text())
        (d / hub.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": doc["weight_map"]}))
    snap = lay_out(hub_cache, "test-org/sharded", COMMIT_A, d, skip=shards)

    def download(repo_id, **kw):
        assert not any(p.endswith(".safetensors") for p in kw["allow_patterns"]), "downloaded weights"
        return str(snap)

    monkeypatch.setattr(hub, "snapshot_download", download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return snap, shards, total


def test_weights_that_cannot_fit_on_disk_are_not_downloaded(hub_cache, tmp_path, monkeypatch):
    snap, shards, total = _online_without_weights(hub_cache, tmp_path, monkeypatch, index=True)
    monkeypatch.setattr(hub, "remote_sizes", lambda *a: pytest.fail("asked the Hub: the index's total_size says it"))
    ref = hub.HubRef("test-org/sharded")
    assert hub.download_bytes(ref, COMMIT_A, snap, hub.SAFETENSORS_INDEX, shards) == total
    monkeypatch.setattr(hub, "free_disk", lambda where: total - 1)
    with pytest.raises(SelfSpecError, match=r"test-org/sharded needs [\d.]+ GB of disk to download its weights; [\d.]+ GB free in "):
        selfspec.load("test-org/sharded")


def test_without_a_total_size_the_hub_gives_the_shards_sizes_at_the_commit(hub_cache, tmp_path, monkeypatch):
    snap, shards, _ = _online_without_weights(hub_cache, tmp_path, monkeypatch, index=False)
    asked = []

    def sizes(ref, commit, files):
        asked.append((commit, files))
        return dict.fromkeys(files, 10**12)

    monkeypatch.setattr(hub, "remote_sizes", sizes)
    monkeypatch.setattr(hub, "free_disk", lambda where: 10**12)
    with pytest.raises(SelfSpecError, match=rf"needs {len(shards) * 1000:.1f} GB of disk to download its weights; 1000.0 GB free"):
        selfspec.load("test-org/sharded")
    assert asked == [(COMMIT_A, shards)]


def test_the_weights_come_from_the_commit_the_first_round_resolved(hub_cache, tmp_path, monkeypatch):
    src_a, hf_a = tiny_dir(tmp_path, 0)
    src_b, _ = tiny_dir(tmp_path, 1)
    snap_a = lay_out(hub_cache, "test-org/tiny", COMMIT_A, src_a)
    lay_out(hub_cache, "test-org/tiny", COMMIT_B, src_b, refs=())

    def push():  # main moves to another commit between the two rounds
        (hub_cache / "models--test-org--tiny" / "refs" / "main").write_text(COMMIT_B)

    asked = recording_download(monkeypatch, after_first=push)
    assert hub.resolve(hub.HubRef("test-org/tiny")) == snap_a
    assert [rev for rev, _ in asked] == [None, COMMIT_A]


def test_pickled_shards_are_loaded_one_at_a_time(tmp_path, monkeypatch):
    src, hf = tiny_dir(tmp_path, 0)
    d = tmp_path / "pkl-sharded"
    d.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    sd = hf.state_dict()
    names = list(sd)
    cut = [0, len(names) // 3, 2 * len(names) // 3, len(names)]
    weight_map = {}
    for s in range(3):
        fname = f"pytorch_model-{s + 1:05d}-of-00003.bin"
        torch.save({n: sd[n].clone() for n in names[cut[s]:cut[s + 1]]}, d / fname)
        weight_map.update(dict.fromkeys(names[cut[s]:cut[s + 1]], fname))
    (d / hub.PICKLE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    live, held, real = weakref.WeakSet(), [], torch.load

    def load(*a, **k):  # how many tensors of the shards loaded before are still held
        gc.collect()
        held.append(len(live))
        shard = real(*a, **k)
        live.update(shard.values())
        return shard

    monkeypatch.setattr(torch, "load", load)
    m = selfspec.load(str(d), allow_pickle=True)
    monkeypatch.undo()
    assert m.fingerprint == selfspec.load(hf).fingerprint
    assert len(held) >= 3 and max(held) <= 2, held  # at most the parts of the matrix being laid out
