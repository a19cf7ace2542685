"""The LayerSkip recipe (Elhoushi et al. 2024): layer dropout + early-exit loss, so that the
model's early layers, read through its own final norm and LM head, predict what its last
layer would. Recipe `lm` is the same loop with neither (the plain next-token baseline).

One micro-batch, for this rank's rows of the global batch:

    keep[b, l]  = u[b, l] >= p(l, t)            u ~ U(0,1) drawn for the *global* batch from
                                                a generator seeded by (seed, step, micro), so
                                                the draw does not depend on the number of ranks
                                                and a resumed run repeats it exactly
    h_l         = decoder layers with per-sample dropout (decoder.py), l in the active exits
    loss        = sum_l  w_l * sum_{b,t} CE(head(h_l)[b,t], y[b,t]) * m[b,t] / N_l

w_l are the normalised exit weights (schedules.py), m the target mask (prompts of
prompt/response data are not targets), and N_l the number of targets in the *whole* step
(all micro-batches, all ranks), so summing gradients over micro-batches and ranks gives the
exact gradient of the global mean, whatever the split. The final layer's loss always covers
the full vocabulary; with --exit-loss-vocab N the other exits' losses are computed over the
N most frequent target tokens only (targets outside them are left out of those exits, and
N_l counts the remaining ones), which cuts the cost of every extra exit by V/N.
Non-final exits' logits are recomputed in the backward pass (activation checkpointing), and
on big vocabularies every exit's logits are computed in row chunks, so at most one chunk of
[rows, V] logits is alive at a time instead of L x [B, T, V].
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from selfspec.training import schedules
from selfspec.training.config import TrainConfig
from selfspec.training.data import Corpus, most_frequent_targets
from selfspec.training.decoder import Decoder
from selfspec.training.distributed import Dist, all_reduce_sum
from selfspec.training.models import save_model_dir


LOGITS_PER_CHUNK = 2**26  # fp32 logits alive at once per exit (256 MB): bounds memory on big vocabularies


def _ce_sum(dec: Decoder, h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """sum_rows CE * weight; h [n, H], targets/weights [n]."""
    logits = dec.logits(h, vocab)
    return (F.cross_entropy(logits, targets, reduction="none") * weights).sum()


def exit_ce_sum(dec: Decoder, h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, vocab: torch.Tensor | None,
                recompute: bool) -> torch.Tensor:
    """sum_{b,t} CE * weight for one exit; h [B, T, H], targets/weights [B, T]. Rows go in
    chunks of at most LOGITS_PER_CHUNK logits; with `recompute` (or more than one chunk)
    each chunk's logits are recomputed in the backward pass instead of kept."""
    V = dec.model.config.vocab_size if vocab is None else vocab.numel()
    h, targets, weights = h.reshape(-1, h.shape[-1]), targets.reshape(-1), weights.reshape(-1)
    rows = max(1, LOGITS_PER_CHUNK // V)
    if not recompute and rows >= h.shape[0]:
        return _ce_sum(dec, h, targets, weights, vocab)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], rows):
        sl = slice(i, i + rows)
        total = total + checkpoint(_ce_sum, dec, h[sl], targets[sl], weights[sl], vocab, use_reentrant=False)
    return total


DEGENERATE_SHARE = 0.5  # the final layer predicting one token this often: agreement with it means little


def degenerate_caveat(ev: dict) -> str | None:
    """A barely trained model predicts one token almost everywhere, and every early exit
    'agrees' with it: say so beside the agreement it reports."""
    share = ev.get("final_top_token_share")
    if share is None or share < DEGENERATE_SHARE:
        return None
    return (f"the last layer predicts one token at {share:.0%} of held-out positions ({ev.get('final_distinct_tokens')} "
            "distinct tokens), so exit agreement is not a sign of good drafts yet; train longer")


class LayerSkipTask:
    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, tokenizer, corpus: Corpus, d: Dist):
        self.cfg, self.model, self.tokenizer, self.corpus, self.dist = cfg, model, tokenizer, corpus, d
        self.dec = Decoder(model)
        self.L = self.dec.num_layers
        ls = cfg.layerskip
        self.plain = cfg.recipe == "lm"
        self.p_max = 0.0 if self.plain else ls.layer_dropout_max
        self.e_scale = 0.0 if self.plain else ls.early_exit_scale
        self.curriculum = cfg.dropout_curriculum
        V = model.config.vocab_size
        self.exit_vocab: torch.Tensor | None = None
        self.exit_slot: torch.Tensor | None = None  # token id -> position in exit_vocab, or -1
        if ls.exit_loss_vocab is not None and ls.exit_loss_vocab < V and not self.plain:
            self.exit_vocab = most_frequent_targets(corpus.train, V, ls.exit_loss_vocab).to(d.device)
            self.exit_slot = torch.full((V,), -1, dtype=torch.long, device=d.device)
            self.exit_slot[self.exit_vocab] = torch.arange(self.exit_vocab.numel(), device=d.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._norm: dict[str, float] = {}
        self.curriculum_steps = cfg.loop.max_steps  # the curricula's horizon (the loop keeps a run's first one)

    # ---- what the loop needs --------------------------------------------------------------

    def num_sequences(self) -> int:
        return self.corpus.train.num_sequences

    def tokens_per_sequence(self) -> int:
        return self.corpus.train.seq_len

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices (embeddings included, nanoGPT-style), not on norms/biases."""
        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]

    def train(self, on: bool) -> None:
        self.model.train(on)

    def exits_at(self, step: int) -> list[int]:
        if self.e_scale == 0.0:
            return [self.L - 1]
        ls = self.cfg.layerskip
        return schedules.active_exits(step, self.curriculum_steps, self.L, ls.early_exit_curriculum,
                                      ls.early_exit_rotation, ls.early_exit_gradual_fraction)

    def dropout_rates(self, step: int) -> list[float]:
        ls = self.cfg.layerskip
        return schedules.layer_dropout_rates(step, self.curriculum_steps, self.L, self.p_max,
                                             ls.layer_dropout_schedule, self.curriculum)

    def keep_mask(self, step: int, micro: int, global_rows: int, start: int, end: int) -> torch.Tensor | None:
        """keep [end-start, L] for rows start..end-1 of the global micro-batch (module doc)."""
        rates = torch.tensor(self.dropout_rates(step))
        if not bool((rates > 0).any()):
            return None
        g = torch.Generator().manual_seed(self.cfg.loop.seed * 1_000_003 + step * 1009 + micro)
        u = torch.rand(global_rows, self.L, generator=g)
        return (u[start:end] >= rates[None]).to(self.dist.device)

    def begin_step(self, step: int, indices: list[int]) -> None:
        """Normalisers for the whole step: target counts over every micro-batch and rank."""
        _, targets, weights = self.corpus.train.sequences(indices)
        n_all = float(weights.sum())
        n_exit = n_all
        if self.exit_slot is not None:
            n_exit = float((weights & (self.exit_slot.cpu()[targets] >= 0)).sum())
        self._norm = {"all": max(n_all, 1.0), "exit": max(n_exit, 1.0)}

    def micro_loss(self, step: int, micro: int, rows: list[int], start: int, global_rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, targets, weights = (t.to(self.dist.device) for t in self.corpus.train.sequences(rows))
        w = weights.float()
        exits = self.exits_at(step)
        scales = schedules.exit_loss_scales(exits, self.L, self.cfg.layerskip.early_exit_scale_type, self.e_scale)
        keep = self.keep_mask(step, micro, global_rows, start, start + len(rows)) if self.model.training else None
        hs = self.dec.hidden_states(ids, keep, {l for l, s in zip(exits, scales) if s > 0} | {self.L - 1})
        total = torch.zeros((), device=self.dist.device)
        final = torch.zeros((), device=self.dist.device)
        for l, s in zip(exits, scales):
            if l == self.L - 1:
                ce = exit_ce_sum(self.dec, hs[l], targets, w, None, recompute=False) / self._norm["all"]
                final = ce.detach()
            elif s > 0 and self.exit_slot is not None:
                slot = self.exit_slot[targets]
                ce = exit_ce_sum(self.dec, hs[l], slot.clamp(min=0), w * (slot >= 0), self.exit_vocab, recompute=True) / self._norm["exit"]
            elif s > 0:
                ce = exit_ce_sum(self.dec, hs[l], targets, w, None, recompute=True) / self._norm["all"]
            else:
                continue
            total = total + s * ce
        return total, {"loss": total.detach(), "final_loss": final}

    # ---- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batch_size: int) -> dict:
        """Held-out text, no dropout: per layer, the exit loss (full vocabulary), top-1
        accuracy, and top-1 agreement with the final layer (what a greedy early-exit draft
        at E = l+1 would have to match). Ranks split the sequences; sums are all-reduced."""
        was = self.model.training
        self.model.eval()
        idx = self.corpus.eval_indices(self.cfg.data.eval_sequences)
        mine = idx[self.dist.rank :: self.dist.world]
        L = self.L
        sums = torch.zeros(3, L + 1, dtype=torch.float64)  # loss, correct, agree per layer; [*, L] = n targets
        V = self.model.config.vocab_size
        final_counts = torch.zeros(V, dtype=torch.float64)  # how often the final layer predicts each token
        for b in range(0, len(mine), batch_size):
            ids, targets, weights = (t.to(self.dist.device) for t in self.corpus.eval.sequences(mine[b : b + batch_size]))
            hs = self.dec.hidden_states(ids)
            final_top = self.dec.logits(hs[L - 1]).argmax(-1)
            m = weights.reshape(-1)
            final_counts += torch.bincount(final_top.reshape(-1)[m].cpu(), minlength=V).double()
            for l in range(L):
                logits = self.dec.logits(hs[l]).reshape(-1, self.model.config.vocab_size)
                top = logits.argmax(-1)
                sums[0, l] += float((F.cross_entropy(logits, targets.reshape(-1), reduction="none") * m).sum())
                sums[1, l] += float(((top == targets.reshape(-1)) & m).sum())
                sums[2, l] += float(((top == final_top.reshape(-1)) & m).sum())
            sums[:, L] += float(m.sum())
        sums = all_reduce_sum(self.dist, sums.to(self.dist.device)).cpu()
        final_counts = all_reduce_sum(self.dist, final_counts.to(self.dist.device)).cpu()
        self.model.train(was)
        n = max(float(sums[0, L]), 1.0)
        ev = {
            "eval_tokens": int(sums[0, L]),
            "eval_loss": float(sums[0, L - 1]) / n,
            "exit_loss": [float(x) / n for x in sums[0, :L]],
            "exit_accuracy": [float(x) / n for x in sums[1, :L]],
            "exit_agreement": [float(x) / n for x in sums[2, :L]],
            "final_top_token_share": float(final_counts.max()) / n,
            "final_distinct_tokens": int((final_counts > 0).sum()),
        }
        caveat = degenerate_caveat(ev)
        if caveat:
            ev["caveat"] = caveat
        return ev

    @staticmethod
    def summary(ev: dict) -> str:
        agree = ev["exit_agreement"]
        L = len(agree)
        marks = sorted({max(0, L // 4 - 1), max(0, L // 2 - 1), max(0, 3 * L // 4 - 1)})
        line = f"eval loss {ev['eval_loss']:.3f} | exit agreement " + " ".join(f"L{l + 1}:{agree[l]:.0%}" for l in marks)
        return line + (f" | caveat: {ev['caveat']}" if ev.get("caveat") else "")

    # ---- saving ----------------------------------------------------------------------------

    def save_weights(self, path: Path) -> None:
        save_model_dir(self.model, self.tokenizer, path)

    def save_final(self, path: Path) -> None:
        save_model_dir(self.model, self.tokenizer, path)
