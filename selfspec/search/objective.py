"""A trial's measured speedup in timed generations (measure); its predicted one is
predictor/objective.predict."""

from __future__ import annotations

from selfspec.config import DraftConfig


def measure(model, cfg: DraftConfig, prompts: list[str], max_new_tokens: int, repeats: int = 1) -> dict:
    """Plain decoding and cfg on each prompt, interleaved; -> speedup of summed times and
    whether every output matched."""
    base_cfg = DraftConfig("autoregressive")
    t_ar = t_sp = 0.0
    same = True
    tokens = 0
    acc = drafted = 0
    for _ in range(repeats):
        for p in prompts:
            a = model.generate(p, max_new_tokens=max_new_tokens, draft=base_cfg)
            b = model.generate(p, max_new_tokens=max_new_tokens, draft=cfg)
            t_ar += a.stats.time_s
            t_sp += b.stats.time_s
            tokens += b.stats.new_tokens
            same &= a.token_ids == b.token_ids
            acc += b.stats.accepted
            drafted += b.stats.drafted
    return {
        "measured_speedup": t_ar / t_sp if t_sp > 0 else 0.0,
        "ar_tokens_per_second": tokens / t_ar if t_ar else 0.0,
        "tokens_per_second": tokens / t_sp if t_sp else 0.0,
        "measured_acceptance_rate": acc / drafted if drafted else 0.0,
        "identical_to_autoregressive": bool(same),
    }
