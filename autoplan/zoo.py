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
import dataclasses
import difflib
import importlib.util
import inspect
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .errors import ConfigError, UserCodeError

__all__ = ["ZOO", "TITLES", "ZooEntry", "SPARSE_ZOO", "SparseZooEntry", "build_model",
           "build_sparse_model", "model_title", "parse_model_args", "trace"]


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
    # 141B total / 39B active (Mistral AI, "Cheaper, Better, Faster, Stronger", Apr 2024)
    "mixtral-8x22b": ZooEntry("mixtral", dict(hidden_size=6144, intermediate_size=16384,
                                              num_hidden_layers=56, num_attention_heads=48,
                                              num_key_value_heads=8, vocab_size=32768,
                                              max_position_embeddings=65536,
                                              num_local_experts=8, num_experts_per_tok=2), 4096,
                              "mistralai/Mixtral-8x22B-v0.1 config.json (HF); 56 layers, hidden 6144, "
                              "48 heads / 8 KV, expert FFN 16384, 8 experts top-2 also in NeMo "
                              "MixtralConfig8x22B"),
    # 235B total / 22B active; every layer MoE (decoder_sparse_step 1, mlp_only_layers [])
    "qwen3-235b-a22b": ZooEntry("qwen3_moe", dict(hidden_size=4096, intermediate_size=12288,
                                                  num_hidden_layers=94, num_attention_heads=64,
                                                  num_key_value_heads=4, head_dim=128,
                                                  vocab_size=151936, moe_intermediate_size=1536,
                                                  num_experts=128, num_experts_per_tok=8,
                                                  norm_topk_prob=True, max_position_embeddings=40960,
                                                  tie_word_embeddings=False), 4096,
                                "Qwen/Qwen3-235B-A22B config.json (HF); Qwen3 Technical Report "
                                "(Yang et al. 2025, arXiv:2505.09388), Table 2"),
    # 671B total / 37B active; MLA, 1 shared + 256 routed experts (top-8), first 3 layers dense;
    # the multi-token-prediction module (num_nextn_predict_layers=1) is not part of the HF model
    "deepseek-v3": ZooEntry("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432,
                                                moe_intermediate_size=2048, num_hidden_layers=61,
                                                num_attention_heads=128, num_key_value_heads=128,
                                                q_lora_rank=1536, kv_lora_rank=512,
                                                qk_nope_head_dim=128, qk_rope_head_dim=64,
                                                v_head_dim=128, n_routed_experts=256,
                                                n_shared_experts=1, num_experts_per_tok=8,
                                                n_group=8, topk_group=4, first_k_dense_replace=3,
                                                routed_scaling_factor=2.5, norm_topk_prob=True,
                                                vocab_size=129280, max_position_embeddings=4096), 4096,
                            "deepseek-ai/DeepSeek-V3 config.json (HF) and inference/configs/"
                            "config_671B.json; DeepSeek-V3 Technical Report (arXiv:2412.19437), "
                            "Sec. 4.2; README_WEIGHTS.md (671B main-model parameters)"),
    # 116.8B total / 5.1B active; alternating 128-token sliding-window and full attention
    "gpt-oss-120b": ZooEntry("gpt_oss", dict(hidden_size=2880, intermediate_size=2880,
                                             num_hidden_layers=36, num_attention_heads=64,
                                             num_key_value_heads=8, head_dim=64,
                                             num_local_experts=128, num_experts_per_tok=4,
                                             sliding_window=128, vocab_size=201088), 4096,
                             "openai/gpt-oss-120b config.json (HF); gpt-oss-120b & gpt-oss-20b "
                             "Model Card (OpenAI, Aug 2025), Table 1"),
}


#: Names people know the zoo's models by (plans and reports print them).
TITLES: dict[str, str] = {
    "gpt3-175b": "GPT-3 175B", "gpt3-1.3b": "GPT-3 1.3B", "llama3-8b": "Llama 3 8B",
    "llama3-70b": "Llama 3 70B", "llama3-405b": "Llama 3.1 405B", "bert-large": "BERT-Large",
    "t5-11b": "T5-11B", "mixtral-8x7b": "Mixtral 8x7B", "mixtral-8x22b": "Mixtral 8x22B",
    "qwen3-235b-a22b": "Qwen3-235B-A22B", "deepseek-v3": "DeepSeek-V3 671B",
    "gpt-oss-120b": "gpt-oss-120b",
}


@dataclass(frozen=True)
class SparseZooEntry:
    """A shipped embedding-heavy model (:mod:`autoplan.sparse`): its builder, one example
    batch (shapes only: ids per sample per table), its name and the source of its shape."""

    factory: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]
    title: str
    source: str


def _dlrm_dcnv2() -> nn.Module:
    from .sparse.models import DLRM, MLPERF_DCNV2_HOT, MLPERF_DCNV2_ROWS
    return DLRM(MLPERF_DCNV2_ROWS, 128, hot=MLPERF_DCNV2_HOT, bottom=(512, 256),
                top=(1024, 1024, 512, 256, 1), interaction="dcn", cross_layers=3, cross_rank=512)


def _dlrm_criteo() -> nn.Module:
    from .sparse.models import CRITEO_1TB_ROWS, DLRM
    return DLRM(CRITEO_1TB_ROWS, 128, bottom=(512, 256), top=(1024, 1024, 512, 256, 1))


def _two_tower() -> nn.Module:
    from .sparse.models import TwoTower
    return TwoTower(100_000_000, 20_000_000, 10_000, 128, tower=(512, 256, 128))


def _dlrm_inputs(hot: int) -> Callable[[int], tuple]:
    return lambda batch: (torch.zeros(batch, 13), torch.zeros(batch, hot, dtype=torch.long))


def _two_tower_inputs(batch: int) -> tuple:
    ids = torch.zeros(batch, dtype=torch.long)
    return ids, torch.zeros(batch, 50, dtype=torch.long), ids, ids


SPARSE_ZOO: dict[str, SparseZooEntry] = {
    "dlrm-dcnv2": SparseZooEntry(
        _dlrm_dcnv2, _dlrm_inputs(214), "DLRM-DCNv2 (MLPerf)",
        "MLPerf Training DLRM-DCNv2 (mlcommons/training recommendation_v2/torchrec_dlrm): 13 dense "
        "features, 26 tables capped at 40M rows, dimension 128, multi-hot sizes 3,2,1,...,1,1 "
        "(214 ids per sample), bottom MLP 512-256-128, DCNv2 3 low-rank (512) cross layers, "
        "top MLP 1024-1024-512-256-1"),
    "dlrm-criteo": SparseZooEntry(
        _dlrm_criteo, _dlrm_inputs(26), "DLRM (Criteo 1TB)",
        "TorchRec DLRM example (facebookresearch/dlrm torchrec_dlrm/README.MD): Criteo 1TB, 26 "
        "one-hot tables of full cardinality (up to 48.9M rows, 91.1 GiB), dimension 128, dot "
        "interaction, bottom MLP 512-256-128, top MLP 1024-1024-512-256-1"),
    "two-tower": SparseZooEntry(
        _two_tower, _two_tower_inputs, "Two-tower retrieval",
        "a two-tower retrieval model (Yi et al. 2019; TorchRec examples/retrieval): user id "
        "(100M rows), mean of the last 50 items (20M rows), item id (20M rows) and category "
        "(10k rows), dimension 128, towers 512-256-128; table sizes illustrative of "
        "production retrieval, not a published configuration"),
}


def build_sparse_model(spec: str, *, device: str = "meta",
                       batch: int = 8) -> tuple[nn.Module, tuple, str]:
    """A shipped embedding-heavy model (``zoo:dlrm-dcnv2``...): ``(model, example inputs
    of ``batch`` samples, title)``; on the meta device by default (nothing allocated)."""
    name = spec[4:] if spec.startswith("zoo:") else spec
    if name not in SPARSE_ZOO:
        raise ConfigError(f"unknown sparse zoo model {spec!r}{_closest(name, sorted(SPARSE_ZOO))}; "
                          f"available: {', '.join('zoo:' + n for n in sorted(SPARSE_ZOO))}")
    entry = SPARSE_ZOO[name]
    with torch.device(device):
        model = entry.factory()
    return model, entry.inputs(batch), entry.title


def model_title(spec: str, overrides: Mapping[str, Any] | None = None) -> str | None:
    """The name people know a model spec by: the zoo's title (``GPT-3 175B``; ``GPT-3 175B
    (modified)`` with overrides), ``GPT (autoplan.models)`` for ``gpt``; None for other
    specs (the capture names them from their config or class)."""
    if spec.startswith("zoo:") and spec[4:] in ZOO:
        title = TITLES.get(spec[4:], spec[4:])
        return f"{title} (modified)" if overrides else title
    if spec.startswith("zoo:") and spec[4:] in SPARSE_ZOO:
        return SPARSE_ZOO[spec[4:]].title
    if spec == "gpt":
        return "GPT (autoplan.models)"
    return None


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


#: Value kinds named in annotations that ``--model-arg`` values are checked against.
_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}
_KIND_NOUNS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", tuple: "a list", dict: "a dict"}


def _annotated_kinds(annotation: Any) -> set[type] | None:
    """The plain kinds an annotation admits (``"int | None"`` -> {int, NoneType}); ``None``
    when it names anything else (then the value is not checked here)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    kinds: set[type] = set()
    for part in (t.strip() for t in text.replace("Optional[", "").rstrip("]").split("|")):
        if part == "None":
            kinds.add(type(None))
        elif part in _KINDS:
            kinds.add(_KINDS[part])
        else:
            return None
    return kinds


def _typed_value(what: str, key: str, value: Any, default: Any, kinds: set[type] | None) -> Any:
    """``value`` as the kind the field holds (its default's, else its annotation's).

    An int is taken for a float field; a whole float (``4096.0``) for an int field.
    Raises :class:`ConfigError` naming the field, the expected kind and the default.
    """
    if default is not None:
        kinds = {type(default)} | ({type(None)} if kinds and type(None) in kinds else set())
    if not kinds or isinstance(value, type(None)) and type(None) in kinds:
        return value
    plain = isinstance(value, (int, float)) and not isinstance(value, bool)
    if float in kinds and plain:
        return float(value) if int not in kinds or isinstance(value, float) else value
    if int in kinds and plain and float(value).is_integer():
        return int(value)
    if isinstance(value, (list, tuple)) and kinds & {list, tuple}:
        return type(default)(value) if default is not None else value
    if any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds):
        return value
    expected = " or ".join(dict.fromkeys(_KIND_NOUNS.get(k, k.__name__) for k in kinds
                                         if k is not type(None)))
    hint = f" (default {key}={default!r})" if default is not None else ""
    raise ConfigError(f"--model-arg {key}={value!r}: {what} expects {expected}{hint}")


def check_overrides(what: str, overrides: Mapping[str, Any], fields: Mapping[str, Any],
                    annotations: Mapping[str, Any] | None = None,
                    aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``overrides`` checked against a config's ``fields`` (name -> default value).

    Unknown keys are refused with the closest field names; values are typed from the
    field's default (or, for a ``None`` default, its annotation).  ``aliases`` maps
    alternative names to fields (Hugging Face's ``attribute_map``: ``hidden_size`` for
    GPT-2's ``n_embd``).

    Examples
    --------
    >>> check_overrides("gpt", {"layers": "4"}, {"layers": 12})
    Traceback (most recent call last):
    ...
    autoplan.errors.ConfigError: --model-arg layers='4': gpt expects an integer (default layers=12)
    """
    aliases = aliases or {}
    annotations = annotations or {}
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        name = aliases.get(key, key)
        if name not in fields:
            near = difflib.get_close_matches(key, [*fields, *aliases], n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else \
                f"; its fields are {', '.join(sorted(k for k in fields if not k.startswith('_')))}"
            raise ConfigError(f"--model-arg {key}: {what} has no field {key!r}{hint}")
        kinds = _annotated_kinds(annotations[name]) if name in annotations else None
        out[key] = _typed_value(what, key, value, fields[name], kinds)
    return out


def _hf_fields(cfg_cls: type) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """A Hugging Face config class's fields with their defaults, annotations and aliases."""
    fields: dict[str, Any] = {}
    annotations: dict[str, Any] = {}
    if dataclasses.is_dataclass(cfg_cls):        # transformers >= 5: strict dataclasses
        for f in dataclasses.fields(cfg_cls):
            annotations[f.name] = f.type
            fields[f.name] = None
    for name, param in inspect.signature(cfg_cls.__init__).parameters.items():
        if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            fields.setdefault(name, None)
            if param.annotation is not param.empty:
                annotations.setdefault(name, param.annotation)
    try:
        defaults = cfg_cls().to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot be built bare: names only
        defaults = {}
    fields.update({k: v for k, v in defaults.items() if not k.startswith("_")})
    aliases = dict(getattr(cfg_cls, "attribute_map", {}) or {})
    return fields, annotations, aliases


def _hf_model(model_type: str, overrides: dict[str, Any], head: str | None, dtype: torch.dtype,
              device: str = "meta", preset: Mapping[str, Any] | None = None) -> nn.Module:
    from ._optional import require
    tf = require("transformers", "zoo: and hf: models")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"unknown Hugging Face model type {model_type!r}"
                          f"{_closest(model_type, list(CONFIG_MAPPING.keys()))}")
    cfg_cls = CONFIG_MAPPING[model_type]
    # checked here: the config class keeps unknown keys as attributes (a typo is silently
    # ignored) and reports a bad value with a multi-line validation traceback
    overrides = check_overrides(f"{model_type} ({cfg_cls.__name__})", overrides, *_hf_fields(cfg_cls))
    try:
        config = cfg_cls(**{**(preset or {}), **overrides})
    except Exception as exc:  # noqa: BLE001 - the config's own validation, as one line
        reason = " ".join(str(exc).split())
        raise ConfigError(f"bad --model-arg for {model_type}: {reason}") from None
    if head is None:
        head = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"
    auto = {"causal": tf.AutoModelForCausalLM, "masked": tf.AutoModelForMaskedLM,
            "seq2seq": tf.AutoModelForSeq2SeqLM}[head]
    # a model type without this head (BERT has no seq2seq head) is built bare
    bare = type(config) not in getattr(auto, "_model_mapping", {type(config): None})
    cls = tf.AutoModel if bare else auto
    with torch.device(device):
        try:
            model = cls.from_config(config)
        except Exception as exc:  # noqa: BLE001 - a config the model code refuses, as one line
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(f"cannot build a {model_type} model from this config "
                              f"({type(exc).__name__}: {reason[:300]}); check the --model-arg "
                              "values") from None
    return model.to(dtype)


def _gpt_model(overrides: dict[str, Any], dtype: torch.dtype, device: str = "meta") -> nn.Module:
    from .models import GPT, GPTConfig
    fields = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    annotations = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    overrides = check_overrides("gpt (GPTConfig)", overrides, fields, annotations)
    try:
        cfg = GPTConfig(**overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad --model-arg for gpt: {exc}") from None
    with torch.device(device):
        return GPT(cfg).to(dtype)


def _file_model(spec: str, overrides: dict[str, Any]) -> nn.Module:
    path, _, func = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"model file {path!r} does not exist (spec {spec!r}: path/to/file.py:factory)")
    module_spec = importlib.util.spec_from_file_location("_autoplan_user_model", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: their error, one line
        raise user_code_error(exc, path, "importing the file") from exc
    factory: Callable | None = getattr(module, func, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(f"{path} has no function {func!r}{_closest(func, names)}")
    try:
        model = factory(**overrides)
    except Exception as exc:  # noqa: BLE001 - the user's factory: their error, one line
        raise user_code_error(exc, path, f"calling {func}()") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model


def user_code_error(exc: BaseException, path: str, doing: str) -> UserCodeError:
    """``exc``, raised by the user's code in ``path`` while ``doing`` something, as one line
    that names the file and line in that code where it happened (the innermost frame
    there; a syntax error's own position), the exception's type and its message.

    Examples
    --------
    >>> err = user_code_error(ValueError("bad width"), "model.py", "calling make()")
    >>> str(err)
    'your model code failed (calling make()): model.py: ValueError: bad width'
    """
    line, where = None, ""
    if isinstance(exc, SyntaxError) and exc.filename:
        same = os.path.realpath(exc.filename) == os.path.realpath(path)
        file, line = (path if same else exc.filename), exc.lineno
        message = exc.msg
    else:
        file = path
        mine = os.path.realpath(path)
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if os.path.realpath(f.filename) == mine]
        if frames:
            line, where = frames[-1].lineno, f", in {frames[-1].name}"
        message = str(exc)
    message = " ".join(message.split())
    if len(message) > 300:
        message = message[:297] + "..."
    at = f"{file}, line {line}{where}" if line is not None else file
    return UserCodeError(f"your model code failed ({doing}): {at}: {type(exc).__name__}"
                         + (f": {message}" if message else ""), file=file, line=line)


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
    if spec.startswith("zoo:") and spec[4:] in SPARSE_ZOO:
        if overrides:
            raise ConfigError(f"{spec} takes no --model-arg; build the model in a file "
                              "(path/to/file.py:factory) to change its shape")
        model, _, _ = build_sparse_model(spec, device=device)
        return model, None
    if spec.startswith("zoo:"):
        name = spec[4:]
        if name not in ZOO:
            raise ConfigError(f"unknown zoo model {name!r}{_closest(name, sorted(ZOO) + sorted(SPARSE_ZOO))}; "
                              f"available: {', '.join(sorted(ZOO) + sorted(SPARSE_ZOO))}")
        entry = ZOO[name]
        return _hf_model(entry.model_type, overrides, entry.head, dtype, device,
                         preset=entry.config), entry.seq_len
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


def trace(model: Any, *, seq_len: int | None = None, **kwargs: Any):
    """:func:`autoplan.capture.trace` that also takes a model spec, as ``whatif`` does.

    ``model`` is an ``nn.Module`` or a spec for :func:`build_model` (``"zoo:llama3-8b"``,
    ``"hf:llama"``, ``"gpt"``, ``"path/to/file.py:factory"``), built on the meta device;
    ``seq_len`` defaults to the zoo entry's.  Other arguments go to the capture.

    Examples
    --------
    >>> g = trace("gpt", seq_len=16)
    >>> g.layers[1].name
    'blocks.0'
    """
    from .capture import trace as capture
    if isinstance(model, str) and model.startswith("zoo:") and model[4:] in SPARSE_ZOO:
        built, inputs, title = build_sparse_model(model)
        kwargs.setdefault("example_inputs", inputs)
        kwargs.setdefault("title", title)
        return capture(built, seq_len=seq_len, **kwargs)
    if isinstance(model, str):
        kwargs.setdefault("title", model_title(model))
        model, default_seq = build_model(model)
        seq_len = seq_len or default_seq
    return capture(model, seq_len=seq_len, **kwargs)
