"""`selfspec train`, as a recipe: output directory, data, tokenizer, model, task, loop, result.

    from selfspec.training import TrainConfig, train
    result = train(TrainConfig(recipe="layerskip", out="runs/ls", model=ModelConfig(preset="llama-12l"), ...))
    selfspec.load(result.final)   # layerskip / lm: a HF directory
    # exit-adapter: result.final / "adapter.safetensors" and a profile for generate(profile=result.final / "profile.json")

Runs as one process, or as N under `torchrun --nproc-per-node N -m selfspec train ...`
(rank 0 writes every file; see distributed.py).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

import selfspec
from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text
from selfspec.training import checkpoint as ckpt
from selfspec.training import data as data_mod
from selfspec.training import distributed, models
from selfspec.training.adapter_train import AdapterTask, check_model
from selfspec.training.config import RESUMABLE_CHANGES, TrainConfig
from selfspec.training.layerskip import LayerSkipTask
from selfspec.training.loop import LoopResult, run_loop

TRAINING_JSON = "training.json"


@dataclass
class TrainResult:
    out: Path
    final: Path
    loop: LoopResult
    summary: dict
    is_main: bool = True  # rank 0 (the process that wrote the files)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_resumable(saved: TrainConfig, now: TrainConfig) -> None:
    """Only budgets and logging may change between a run and its continuation."""
    a, b = saved.to_dict(), now.to_dict()
    for key in a:
        if key == "resume":
            continue
        if isinstance(a[key], dict):
            for k in a[key]:
                if k not in RESUMABLE_CHANGES.get(key, set()) and a[key][k] != b[key].get(k):
                    raise SelfSpecError(f"--resume: --{k.replace('_', '-')} was {a[key][k]!r} in this run, now {b[key].get(k)!r}; "
                                        "only budgets and logging may change")
        elif a[key] != b[key]:
            raise SelfSpecError(f"--resume: --{key} was {a[key]!r} in this run, now {b[key]!r}")


def _context_of(cfg: TrainConfig) -> int | None:
    """The model's context length, when it is known without loading weights."""
    if cfg.model.preset:
        if cfg.model.preset not in models.PRESETS:
            raise SelfSpecError(f"unknown preset {cfg.model.preset!r}; choose from {', '.join(models.PRESETS)}")
        return models.PRESET_CONTEXT
    return None


def _check_seq_len(cfg: TrainConfig, context: int | None) -> None:
    if context is not None and cfg.data.seq_len > context:
        raise SelfSpecError(f"--seq-len {cfg.data.seq_len} exceeds the model's context ({context} tokens)")


def _build_lm(cfg: TrainConfig, docs, resume_from: Path | None, log, dist_info, tokenizer=None):
    """(model, tokenizer) for the layerskip / lm recipes; a given tokenizer is used as is."""
    mc = cfg.model
    if resume_from is not None:
        tokenizer = data_mod.load_tokenizer(str(resume_from))
        model = models.new_model(AutoConfig.from_pretrained(str(resume_from), local_files_only=True), cfg.loop.seed)
        models.load_weights(model, models.read_model_weights(resume_from), str(resume_from))
        return model, tokenizer
    if not mc.from_scratch:
        model, tokenizer, name = models.load_pretrained(mc.model)
        return model, tokenizer
    if tokenizer is not None:
        pass
    elif mc.tokenizer:
        tokenizer = data_mod.load_tokenizer(mc.tokenizer)
    else:  # learnt on rank 0 and sent to the others: every rank must hold the same vocabulary
        t = time.perf_counter()
        spec = None
        if dist_info.is_main:
            train_docs = [doc for doc in docs if not data_mod.is_held_out(doc.id, cfg.data.eval_fraction)] or docs
            spec = data_mod.train_bpe_tokenizer(train_docs, mc.train_tokenizer).backend_tokenizer.to_str()
        tokenizer = data_mod.bpe_tokenizer_from_json(distributed.broadcast_object(dist_info, spec))
        log(f"trained a {len(tokenizer)}-token BPE tokenizer in {time.perf_counter() - t:.1f} s")
    if tokenizer.eos_token_id is None:
        raise SelfSpecError("the tokenizer has no end-of-text token: training packs documents separated by it")
    config = models.preset_config(mc.preset, tokenizer) if mc.preset else models.file_config(mc.config, tokenizer)
    _check_seq_len(cfg, config.max_position_embeddings)
    return models.new_model(config, cfg.loop.seed), tokenizer


def train(
    cfg: TrainConfig,
    *,
    log: Callable[[str], None] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    corpus: data_mod.Corpus | None = None,
    tokenizer=None,
) -> TrainResult:
    """Run a recipe. `corpus` + `tokenizer` (from a previous run) skip reading and
    tokenizing the data again (the demo scripts train twice on the same text)."""
    cfg = cfg.resolved()
    d = distributed.init(cfg.loop.device)
    say = (log or _stderr) if d.is_main else (lambda msg: None)
    try:
        if cfg.loop.threads:
            torch.set_num_threads(cfg.loop.threads)
        out = Path(cfg.out).expanduser()

        # 1. the output directory: writable, and an earlier run is only ever resumed
        resume_from, state = _output_dir(cfg, out, d, say)
        _check_seq_len(cfg, _context_of(cfg))

        # 2. the text, 3. tokenizer + model, 4. the task
        t = time.perf_counter()
        docs = data_mod.read_documents(cfg.data) if corpus is None else None
        if cfg.recipe == "exit-adapter":
            task, tokenizer, name = _adapter_task(cfg, docs, corpus, d, resume_from, say)
        else:
            task, tokenizer, name = _lm_task(cfg, docs, corpus, tokenizer, d, resume_from, say)
        say(f"data: {task.corpus.describe()} (prepared in {time.perf_counter() - t:.1f} s)")
        say(f"model: {name}; recipe {cfg.recipe}; {d.world} process(es) on {d.device}")

        # 5. the loop
        result = run_loop(cfg, task, d, out, state, say, on_step, title=out.name if out.name == cfg.recipe else f"{cfg.recipe}: {out.name}")

        # 6. the result
        summary = {
            "recipe": cfg.recipe,
            "config": cfg.to_dict(),
            "steps": result.step,
            "tokens": result.tokens,
            "train_seconds": result.train_seconds,
            "stopped_by": result.stopped_by,
            "data": task.corpus.describe(),
            "model": name,
            "eval": result.last_eval,
        }
        final = out / ckpt.FINAL
        if d.is_main:
            def fill(tmp: Path) -> None:
                if cfg.recipe == "exit-adapter":
                    task.save_final(tmp, final, result.last_eval)
                else:
                    task.save_final(tmp)
                atomic_write_text(tmp / TRAINING_JSON, json.dumps(summary, indent=2) + "\n")

            ckpt.write_dir_atomically(final, fill)
            say(f"{result.step} steps, {result.tokens:,} tokens in {result.train_seconds / 60:.1f} min "
                f"({result.tokens / max(result.train_seconds, 1e-9):,.0f} tok/s; stopped by {result.stopped_by}); wrote {final}")
        distributed.barrier(d)
        return TrainResult(out, final, result, summary, d.is_main)
    finally:
        distributed.shutdown(d)


def _output_dir(cfg: TrainConfig, out: Path, d, say) -> tuple[Path | None, dict | None]:
    """Check the output directory (writable; an earlier run is only ever resumed) ->
    (the checkpoint to resume from, its trainer state), or (None, None) for a new run."""
    ckpt.check_output_dir(out, cfg.resume)
    distributed.barrier(d)
    if not cfg.resume:
        return None, None
    resume_from = ckpt.latest_checkpoint(out)
    state = ckpt.read_trainer_state(resume_from)
    check_resumable(TrainConfig.from_dict(state["config"]), cfg)
    if state.get("world", 1) != d.world:
        say(f"note: resuming a {state.get('world', 1)}-process run with {d.world} processes (same global batch)")
    say(f"resuming from {resume_from} (step {state['step']})")
    return resume_from, state


def _lm_task(cfg: TrainConfig, docs, corpus, tokenizer, d, resume_from: Path | None, say):
    """The layerskip / lm recipes' task -> (task, tokenizer, a one-line description of the model)."""
    if corpus is not None and tokenizer is None:
        raise SelfSpecError("pass the tokenizer the corpus was made with")
    model, tokenizer = _build_lm(cfg, docs, resume_from, say, d, tokenizer)
    _check_seq_len(cfg, model.config.max_position_embeddings)
    model.to(d.device)
    distributed.broadcast_parameters(d, model.parameters())
    if corpus is None:
        corpus = data_mod.build_corpus(docs, tokenizer, cfg.data)
    task = LayerSkipTask(cfg, model, tokenizer, corpus, d)
    total, body = models.count_parameters(model)
    name = f"{model.config.model_type}, {task.L} layers, {total / 1e6:.1f}M parameters ({body / 1e6:.1f}M outside the embeddings)"
    return task, tokenizer, name


def _adapter_task(cfg: TrainConfig, docs, corpus, d, resume_from: Path | None, say):
    m = selfspec.load(cfg.model.model, dtype="float32", device=d.device)
    check_model(cfg, m)
    if corpus is None:
        corpus = data_mod.build_corpus(docs, m.tokenizer, cfg.data)
    task = AdapterTask(cfg, m, corpus, d)
    if resume_from is not None:
        task.load_weights(resume_from)
    distributed.broadcast_parameters(d, task.params)
    name = (f"{m.name} (frozen, {m.spec.num_layers} layers) + exit adapter at layer {cfg.adapter.exit_layer}, "
            f"inner size {cfg.adapter.adapter_size}, draft vocabulary {cfg.adapter.draft_vocab or m.spec.vocab_size}")
    return task, m.tokenizer, name
