"""The exit-adapter recipe (Kangaroo-style): the model stays frozen; a small residual block
(an MLP, optionally after causal attention) on the hidden state entering layer E
(selfspec.adapter.ExitAdapter) learns to make the early exit's draft agree with the full model.

Teacher, once per training sequence (no gradients, through selfspec's own runtime, fp32):
    h_E      = layers 0..E-1 (embed -> run_layers(h, 0, E))
    teacher  = final norm + LM head on layers E..L-1's output, over the draft vocabulary
    targets  = top-k of softmax(teacher / tau), renormalised over those k ids
Student:
    draft    = draft_logits(runtime, adapter(h_E), head columns of the draft vocabulary) / tau
    loss     = sum_positions KL(targets || softmax(draft)) * m / N      (m, N as in layerskip.py)

Choice of teacher distribution: restricted to the draft vocabulary and renormalised, since
the draft can only ever propose ids from it, and greedy acceptance needs only its argmax to
match the full model's (the restricted argmax equals the full argmax wherever the full
argmax is in the draft vocabulary; the evaluation reports how often that is: `coverage`).
Only the top-k teacher probabilities are kept per position so the teacher pass can be
cached: the frozen model runs over each training sequence once (--teacher-tokens of them)
and later epochs revisit the cache, which makes an adapter step far cheaper than a
teacher pass.

Evaluation on held-out sequences (teacher outputs cached once): top-1 agreement of the
adapter's draft with the full model's argmax over the *full* vocabulary, next to plain
early exit at the same E with the same draft vocabulary (= the adapter at initialisation)
and with the full vocabulary.

Output: OUT/final/adapter.safetensors (selfspec.adapter.save_adapter) and
OUT/final/profile.json, a draft profile for the `exit-adapter` strategy pointing at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.adapter import AdapterMeta, ExitAdapter, draft_logits, load_adapter, save_adapter
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import Profile, save_profile
from selfspec.training.config import TrainConfig
from selfspec.training.data import Corpus, sequence_order
from selfspec.training.distributed import Dist, all_reduce_sum

ADAPTER_FILE = "adapter.safetensors"
PROFILE_FILE = "profile.json"


@dataclass
class Teacher:
    h: torch.Tensor  # [T, H] fp32: the hidden state entering layer E
    top_ids: torch.Tensor  # [T, k] int32 (cache memory): positions in the draft vocabulary
    top_p: torch.Tensor  # [T, k] fp32: teacher probabilities over those, renormalised


@dataclass
class EvalTeacher(Teacher):
    full_top: torch.Tensor = None  # [T]: the full model's argmax over the whole vocabulary
    exit_top: torch.Tensor = None  # [T]: plain early exit's argmax over the draft vocabulary (as ids)
    exit_top_full: torch.Tensor = None  # [T]: plain early exit's argmax over the whole vocabulary


def teacher_targets(logits: torch.Tensor, tau: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, N] -> (p [T, k], ids [T, k]): the top-k of softmax(logits / tau), renormalised."""
    top_p, top_ids = (logits / tau).softmax(-1).topk(k, dim=-1)
    return top_p / top_p.sum(-1, keepdim=True), top_ids


def distill_kl(draft: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(teacher top-k || softmax(draft / tau)) per position: draft logits [T, N], the
    teacher's ids [T, k] (int64) and probabilities p [T, k] -> [T]."""
    logq = (draft / tau).log_softmax(-1).gather(1, ids)
    return (p * (p.clamp_min(1e-30).log() - logq)).sum(-1)


def check_model(cfg: TrainConfig, m) -> None:
    L, V = m.spec.num_layers, m.spec.vocab_size
    E = cfg.adapter.exit_layer
    if not 1 <= E <= L - 1:
        raise SelfSpecError(f"--exit-layer must be in 1..{L - 1} for this {L}-layer model, got {E}")
    if cfg.adapter.draft_vocab is not None and cfg.adapter.draft_vocab > V:
        raise SelfSpecError(f"--draft-vocab {cfg.adapter.draft_vocab} exceeds the vocabulary size {V}")
    if cfg.data.seq_len > m.context_length:
        raise SelfSpecError(f"--seq-len {cfg.data.seq_len} exceeds the model's context ({m.context_length} tokens)")


class AdapterTask:
    def __init__(self, cfg: TrainConfig, m, corpus: Corpus, d: Dist):
        self.cfg, self.m, self.corpus, self.dist = cfg, m, corpus, d
        self.rt = rt = m.runtime
        a = cfg.adapter
        self.E, self.T, self.tau = a.exit_layer, corpus.train.seq_len, a.distill_temperature
        self.vocab = None if a.draft_vocab is None else m.draft_vocabulary(a.draft_vocab).to(rt.device)  # sorted ids
        # [H, N] columns of the frozen LM head (a plain fp32 tensor, never trained)
        self.head = rt.head_weight() if self.vocab is None else rt.head_columns(self.vocab).contiguous()
        self.k = min(a.teacher_top_k, self.head.shape[1])
        torch.manual_seed(cfg.loop.seed)
        meta = AdapterMeta(exit_layer=self.E, hidden_size=m.spec.hidden_size, inner_size=a.adapter_size,
                           model_fingerprint=m.fingerprint, draft_vocab=a.draft_vocab,
                           heads=a.adapter_heads, head_dim=a.adapter_head_dim)
        self.adapter = ExitAdapter(meta).to(rt.device)
        self.params = list(self.adapter.parameters())
        # the training set: the first teacher_tokens // T sequences of the seeded order
        n = min(corpus.train.num_sequences, max(1, a.teacher_tokens // self.T))
        self.subset = sequence_order(corpus.train.num_sequences, cfg.loop.seed, 0, n)
        # The teacher cache lives in three tensors allocated once ([n, T, ...], filled as
        # sequences are first met): long-lived per-sequence blocks between the step's large
        # temporaries would fragment the heap (a run once grew ~10 MB per sequence to an OOM).
        H = m.spec.hidden_size
        self._h = torch.empty(n, self.T, H, device=rt.device)
        self._top_ids = torch.empty(n, self.T, self.k, dtype=torch.int32, device=rt.device)
        self._top_p = torch.empty(n, self.T, self.k, device=rt.device)
        self._filled = torch.zeros(n, dtype=torch.bool)  # by position in self.subset
        self._eval: dict[int, EvalTeacher] = {}
        self._kv = rt.new_cache(self.T)
        self._norm = 1.0

    # ---- the frozen model's side -----------------------------------------------------------

    @torch.no_grad()
    def _run_teacher(self, ids: torch.Tensor, full: bool) -> tuple[Teacher, torch.Tensor | None, torch.Tensor]:
        rt = self.rt
        with torch.autocast(device_type="cuda" if rt.device.type == "cuda" else "cpu", enabled=False):
            h_e = rt.run_layers(rt.embed(ids), 0, self.E, 0, self._kv)  # [T, H]
            h_l = rt.run_layers(h_e, self.E, rt.num_layers, 0, self._kv)
            if full:
                logits_full = rt.logits(h_l)  # [T, V]
                logits = logits_full if self.vocab is None else logits_full.index_select(1, self.vocab)
                full_top = logits_full.argmax(-1)
            else:
                logits, full_top = rt.logits(h_l, head=self.head), None
            top_p, top_ids = teacher_targets(logits, self.tau, self.k)
        return Teacher(h_e.float(), top_ids.to(torch.int32), top_p), full_top, h_e

    def _teacher(self, i: int) -> Teacher:
        """The teacher of training sequence self.subset[i], run the first time it is met."""
        if not self._filled[i]:
            ids, _, _ = self.corpus.train.sequences([self.subset[i]])
            t = self._run_teacher(ids[0].to(self.rt.device), full=False)[0]
            self._h[i], self._top_ids[i], self._top_p[i] = t.h, t.top_ids, t.top_p
            self._filled[i] = True
        return Teacher(self._h[i], self._top_ids[i], self._top_p[i])

    def _eval_teacher(self, seq: int) -> EvalTeacher:
        if seq not in self._eval:
            ids, _, _ = self.corpus.eval.sequences([seq])
            t, full_top, h_e = self._run_teacher(ids[0].to(self.rt.device), full=True)
            with torch.no_grad():
                exit_full = self.rt.logits(h_e)
                exit_top_full = exit_full.argmax(-1)
                exit_top = exit_top_full if self.vocab is None else self.vocab[exit_full.index_select(1, self.vocab).argmax(-1)]
            self._eval[seq] = EvalTeacher(t.h.clone(), t.top_ids, t.top_p, full_top, exit_top, exit_top_full)
        return self._eval[seq]

    # ---- what the loop needs ---------------------------------------------------------------

    def num_sequences(self) -> int:
        return len(self.subset)

    def tokens_per_sequence(self) -> int:
        return self.T

    def param_groups(self, weight_decay: float) -> list[dict]:
        matrices = [p for p in self.adapter.parameters() if p.dim() == 2]
        gains = [p for p in self.adapter.parameters() if p.dim() < 2]
        return [{"params": matrices, "weight_decay": weight_decay}, {"params": gains, "weight_decay": 0.0}]

    def train(self, on: bool) -> None:
        self.adapter.train(on)

    def begin_step(self, step: int, indices: list[int]) -> None:
        _, _, weights = self.corpus.train.sequences([self.subset[i] for i in indices])
        self._norm = max(float(weights.sum()), 1.0)

    def _kl(self, teachers: list[Teacher], weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sum of weighted per-position KL(teacher top-k || draft), draft argmax [n*T] as
        positions in the draft vocabulary)."""
        h = torch.stack([t.h for t in teachers])  # [n, T, H]: whole sequences (the adapter may attend)
        ids = torch.cat([t.top_ids for t in teachers]).long()  # [n*T, k]
        p = torch.cat([t.top_p for t in teachers])
        logits = draft_logits(self.rt, self.adapter(h).flatten(0, 1), self.head)  # [n*T, N] fp32
        kl = distill_kl(logits, ids, p, self.tau)
        return (kl * weights.reshape(-1).float()).sum(), logits.detach().argmax(-1)

    def micro_loss(self, step: int, micro: int, rows: list[int], start: int, global_rows: int):
        teachers = [self._teacher(i) for i in rows]
        _, _, weights = self.corpus.train.sequences([self.subset[i] for i in rows])
        kl, _ = self._kl(teachers, weights.to(self.rt.device))
        loss = kl / self._norm
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, batch_size: int) -> dict:
        was = self.adapter.training
        self.adapter.eval()
        idx = self.corpus.eval_indices(self.cfg.data.eval_sequences)[self.dist.rank :: self.dist.world]
        # n, kl, adapter agrees, exit agrees (draft vocab), exit agrees (full vocab), full argmax in draft vocab
        sums = torch.zeros(6, dtype=torch.float64)
        for seq in idx:
            t = self._eval_teacher(seq)
            _, _, w = self.corpus.eval.sequences([seq])
            w = w[0].to(self.rt.device)
            kl, top = self._kl([t], w)
            draft = top if self.vocab is None else self.vocab[top]
            covered = torch.ones_like(w) if self.vocab is None else torch.isin(t.full_top, self.vocab)
            sums += torch.tensor([float(w.sum()), float(kl), float(((draft == t.full_top) & w).sum()),
                                  float(((t.exit_top == t.full_top) & w).sum()), float(((t.exit_top_full == t.full_top) & w).sum()),
                                  float((covered & w).sum())], dtype=torch.float64)
        sums = all_reduce_sum(self.dist, sums.to(self.rt.device)).cpu()
        self.adapter.train(was)
        n = max(float(sums[0]), 1.0)
        return {"eval_tokens": int(sums[0]), "distill_loss": float(sums[1]) / n, "adapter_agreement": float(sums[2]) / n,
                "early_exit_agreement": float(sums[3]) / n, "early_exit_agreement_full_vocab": float(sums[4]) / n,
                "coverage": float(sums[5]) / n, "exit_layer": self.E, "draft_vocab": self.cfg.adapter.draft_vocab}

    @staticmethod
    def summary(ev: dict) -> str:
        return (f"held-out KL {ev['distill_loss']:.3f} | agreement with the full model: adapter {ev['adapter_agreement']:.1%}, "
                f"plain early exit {ev['early_exit_agreement']:.1%} (full vocab {ev['early_exit_agreement_full_vocab']:.1%}) "
                f"| coverage {ev['coverage']:.1%}")

    # ---- saving ----------------------------------------------------------------------------

    def save_weights(self, path: Path) -> None:
        save_adapter(self.adapter, path / ADAPTER_FILE)

    def load_weights(self, path: Path) -> None:
        saved = load_adapter(path / ADAPTER_FILE, device=self.rt.device)
        if saved.meta != self.adapter.meta:
            raise SelfSpecError(f"the adapter in {path} does not match this run ({saved.meta} vs {self.adapter.meta})")
        with torch.no_grad():
            for name, p in self.adapter.named_parameters():
                p.copy_(getattr(saved, name))

    def save_final(self, path: Path, final_dir: Path, metrics: dict) -> None:
        """`path` is the temporary directory that becomes `final_dir`: the profile names the
        adapter at its final location."""
        self.save_weights(path)
        a = self.cfg.adapter
        draft = DraftConfig(strategy="exit-adapter", exit_layer=self.E, num_speculations=a.num_speculations, draft_threshold=a.draft_threshold,
                            draft_vocab=a.draft_vocab, adapter=str((final_dir / ADAPTER_FILE).resolve()))
        save_profile(Profile(draft, self.m.fingerprint, self.m.name, metrics), path / PROFILE_FILE)
