"""Training for self-speculation (`selfspec train`).

Recipes
  layerskip     LayerSkip: layer dropout + early-exit loss on a transformers model, from
                scratch (--preset / --config) or continued (--model); result: a HF directory
  lm            the same loop with the plain next-token loss (the baseline)
  exit-adapter  a small residual MLP on a frozen model's layer E, distilled from the full
                model (Kangaroo-style); result: adapter.safetensors + a draft profile

Modules: config (dataclasses = CLI flags), schedules (dropout, exit weights, curricula, lr),
data (documents, tokenizer, packing), models (presets, loading, saving), decoder (our layer
loop over the HF modules), layerskip / adapter_train (the recipes' losses and evaluations),
loop (optimisation, budgets, checkpoints), checkpoint, distributed, plots, trainer (the
recipe script), cli.
"""

from selfspec.training.config import AdapterConfig, DataConfig, LayerSkipConfig, LoopConfig, ModelConfig, TrainConfig
from selfspec.training.trainer import train

__all__ = ["AdapterConfig", "DataConfig", "LayerSkipConfig", "LoopConfig", "ModelConfig", "TrainConfig", "train"]
