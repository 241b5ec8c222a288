"""Named model configurations and model specs for the command line.

A model spec is one of

- ``zoo:<name>``: a shipped configuration (:data:`ZOO`), built from its Hugging Face
  config class with random init on the meta device (nothing is downloaded);
- ``hf:<model_type>``: any Hugging Face model type (``hf:llama``, ``hf:gpt2``), built from
  its config class with the defaults overridden by ``key=value`` arguments;
- ``gpt:`` the package's own GPT (:class:`autoplan.models.GPT`), with ``key=value`` overrides;
- ``path/to/file.py:factory``: a function in a Python file that returns an ``nn.Module``.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import ConfigError

__all__ = ["ZOO", "ZooEntry", "build_model", "parse_model_args"]


@dataclass(frozen=True)
class ZooEntry:
    """A shipped model: HF model type, config overrides, default sequence length, source."""

    model_type: str
    config: dict[str, Any]
    seq_len: int
    source: str
    head: str = "causal"          # causal | masked | seq2seq


ZOO: dict[str, ZooEntry] = {
    "gpt3-175b": ZooEntry("gpt2", dict(n_embd=12288, n_layer=96, n_head=96, n_inner=4 * 12288,
                                       vocab_size=51200, n_positions=2048), 2048,
                          "Brown et al. 2020, Table 2.1 (GPT-3 175B); vocab as Narayanan et al. 2021"),
    "gpt3-1.3b": ZooEntry("gpt2", dict(n_embd=2048, n_layer=24, n_head=16, n_inner=8192,
                                       vocab_size=51200, n_positions=2048), 2048,
                          "Brown et al. 2020, Table 2.1 (GPT-3 XL)"),
    "llama3-8b": ZooEntry("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        max_position_embeddings=8192), 8192,
                          "Meta Llama 3 model card / config.json (8B)"),
    "llama3-70b": ZooEntry("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                         max_position_embeddings=8192), 4096,
                           "Meta Llama 3 model card / config.json (70B)"),
    "llama3-405b": ZooEntry("llama", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                          num_attention_heads=128, num_key_value_heads=8,
                                          vocab_size=128256, max_position_embeddings=8192), 8192,
                            "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 3"),
    "bert-large": ZooEntry("bert", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                        num_attention_heads=16, vocab_size=30522), 512,
                           "Devlin et al. 2019 (BERT-Large)", head="masked"),
    "t5-11b": ZooEntry("t5", dict(d_model=1024, d_ff=65536, d_kv=128, num_heads=128, num_layers=24,
                                  num_decoder_layers=24, vocab_size=32128), 512,
                       "Raffel et al. 2020, T5-11B", head="seq2seq"),
    "mixtral-8x7b": ZooEntry("mixtral", dict(hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32,
                                             num_key_value_heads=8, vocab_size=32000,
                                             num_local_experts=8, num_experts_per_tok=2), 4096,
                             "Jiang et al. 2024 (Mixtral of Experts), Table 1"),
}


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """``["hidden_size=64", "tie=true"]`` -> ``{"hidden_size": 64, "tie": True}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--model-arg expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        lowered = raw.strip().lower()
        if lowered in ("true", "false"):
            out[key.strip()] = lowered == "true"
            continue
        try:
            out[key.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key.strip()] = raw
    return out


def _closest(name: str, names: list[str]) -> str:
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    return f"; did you mean {', '.join(near)}?" if near else ""


def _hf_model(model_type: str, overrides: dict[str, Any], head: str | None, dtype: torch.dtype,
              device: str = "meta") -> nn.Module:
    try:
        import transformers as tf
    except ImportError:
        raise ConfigError("hf: and zoo: models need the transformers package: "
                          "pip install 'autoplan[hf]'") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"unknown Hugging Face model type {model_type!r}"
                          f"{_closest(model_type, list(CONFIG_MAPPING.keys()))}")
    cfg_cls = CONFIG_MAPPING[model_type]
    try:
        config = cfg_cls(**overrides)
    except TypeError as exc:
        raise ConfigError(f"bad --model-arg for {model_type}: {exc}") from None
    for key in overrides:
        if not hasattr(config, key):
            known = sorted(k for k in config.to_dict() if not k.startswith("_"))
            raise ConfigError(f"{model_type} config has no field {key!r}{_closest(key, known)}")
    if head is None:
        head = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"
    auto = {"causal": tf.AutoModelForCausalLM, "masked": tf.AutoModelForMaskedLM,
            "seq2seq": tf.AutoModelForSeq2SeqLM}[head]
    with torch.device(device):
        try:
            model = auto.from_config(config)
        except ValueError:
            model = tf.AutoModel.from_config(config)
    return model.to(dtype)


def _gpt_model(overrides: dict[str, Any], dtype: torch.dtype, device: str = "meta") -> nn.Module:
    from .models import GPT, GPTConfig
    try:
        cfg = GPTConfig(**overrides)
    except TypeError as exc:
        fields = list(GPTConfig.__dataclass_fields__)
        raise ConfigError(f"bad --model-arg for gpt: {exc}; fields are {fields}") from None
    with torch.device(device):
        return GPT(cfg).to(dtype)


def _file_model(spec: str, overrides: dict[str, Any]) -> nn.Module:
    path, _, func = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"model file {path!r} does not exist (spec {spec!r}: path/to/file.py:factory)")
    module_spec = importlib.util.spec_from_file_location("_autoplan_user_model", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory: Callable | None = getattr(module, func, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(f"{path} has no function {func!r}{_closest(func, names)}")
    model = factory(**overrides)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model


def build_model(spec: str, overrides: dict[str, Any] | None = None,
                dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> tuple[nn.Module, int | None]:
    """Build the model a spec names; returns ``(model, default_seq_len)``.

    ``device="meta"`` (the default) allocates nothing: enough to trace and plan a model
    of any size.  A real device (``"cpu"``, ``"cuda"``) initialises real weights, from
    the current torch seed, for training.

    Examples
    --------
    >>> model, seq = build_model("zoo:llama3-8b")
    >>> type(model).__name__, seq, next(model.parameters()).device.type
    ('LlamaForCausalLM', 8192, 'meta')
    """
    overrides = dict(overrides or {})
    if spec.startswith("zoo:"):
        name = spec[4:]
        if name not in ZOO:
            raise ConfigError(f"unknown zoo model {name!r}{_closest(name, sorted(ZOO))}; "
                              f"available: {', '.join(sorted(ZOO))}")
        entry = ZOO[name]
        return _hf_model(entry.model_type, {**entry.config, **overrides}, entry.head, dtype,
                         device), entry.seq_len
    if spec.startswith("hf:"):
        return _hf_model(spec[3:], overrides, None, dtype, device), None
    if spec == "gpt" or spec.startswith("gpt:"):
        model = _gpt_model(overrides, dtype, device)
        return model, model.config.seq_len
    if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
        model = _file_model(spec, overrides)
        return (model if device == "meta" else model.to(device=device, dtype=dtype)), None
    raise ConfigError(f"cannot understand model spec {spec!r}: use zoo:<name> "
                      f"({', '.join(sorted(ZOO))}), hf:<model_type>, gpt, or path/to/file.py:factory"
                      f"{_closest('zoo:' + spec, ['zoo:' + z for z in ZOO])}")
