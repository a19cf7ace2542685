"""selfspec: lossless self-speculative decoding for Hugging Face causal language models."""

from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.engine import GenerationResult, GenerationStats
from selfspec.errors import SelfSpecError
from selfspec.model import SelfSpecModel, load
from selfspec.profiles import Profile, load_profile, save_profile
from selfspec.request import DraftChoice, Request

__version__ = "0.1.0"
__all__ = [
    "DraftChoice",
    "DraftConfig",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "Profile",
    "Request",
    "SamplingConfig",
    "SelfSpecError",
    "SelfSpecModel",
    "load",
    "load_profile",
    "save_profile",
]
