"""exactrl: RL post-training with bitwise-exact (true on-policy) logprobs."""

from importlib.metadata import PackageNotFoundError, version

from exactrl.model import load_model, save_model, sequence_logprobs

try:
    __version__ = version("exactrl")
except PackageNotFoundError:  # the source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"


def load_tokenizer(path):
    from exactrl.model.tokenizer import load_tokenizer as _load

    return _load(path)


def __getattr__(name):  # the engine is imported lazily to keep `import exactrl` light
    if name in ("Engine", "SamplingParams"):
        from exactrl import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["load_model", "save_model", "load_tokenizer", "sequence_logprobs", "Engine", "SamplingParams"]
