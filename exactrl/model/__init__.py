"""One decoder definition, HF checkpoint I/O, the trainer's logprob path."""

from exactrl.model.checkpoint import build_model, init_weights, load_model, read_config, save_model
from exactrl.model.config import ModelConfig
from exactrl.model.logprobs import forward_logits, sequence_logprobs
from exactrl.model.transformer import CausalLM

__all__ = [
    "CausalLM",
    "ModelConfig",
    "build_model",
    "init_weights",
    "load_model",
    "read_config",
    "save_model",
    "sequence_logprobs",
    "forward_logits",
]
