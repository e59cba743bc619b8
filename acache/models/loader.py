"""Loads a model from a local Hugging Face checkpoint directory in the upstream layout.

``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every
problem is reported with the file, tensor or field it concerns.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from acache.models.base import DiffusionLM
from acache.models.config import ConfigError
from acache.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors do not match what its config describes."""


def parse_dtype(dtype: str | torch.dtype, checkpoint: str | None = None) -> torch.dtype:
    """A dtype by name; ``auto`` is the checkpoint's own, ``checkpoint`` (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one this engine runs; choose one of "
                             f"{', '.join(sorted(set(map(str, DTYPES.values()))))}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() == "auto":
        named = str(checkpoint or "float32").lower()
        if named not in DTYPES:
            raise ValueError(f"the checkpoint's dtype {checkpoint!r} is not one this engine runs; pass a dtype: "
                             f"one of {', '.join(sorted(DTYPES))}")
        return DTYPES[named]
    try:
        return DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(sorted(DTYPES))}") from None


def parse_device(device: str | torch.device) -> torch.device:
    """A device by name; ``auto`` is CUDA when there is one, else the CPU."""
    if isinstance(device, str) and device.lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: this engine runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return dev


def checkpoint_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"model directory not found: {root}")
    if not root.is_dir():
        raise NotADirectoryError(f"model path is not a directory: {root}")
    return root


def read_config(path: str | Path) -> tuple[type[DiffusionLM], object]:
    """The model class and parsed :class:`ModelConfig` of a checkpoint directory."""
    config_path = checkpoint_dir(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"missing {CONFIG_FILE} in model directory {config_path.parent}")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path} holds a {type(raw).__name__}, not an object of fields")
    cls = resolve_model_class(raw, str(config_path))
    try:
        return cls, cls.config_from_hf(raw)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None


def tensor_files(root: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor name."""
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc!r}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index} is not a valid safetensors index: its weight_map is not an object of "
                                  "tensor names to file names")
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"weight shard {shard.name} listed in {INDEX_FILE} is missing from {root}")
        return files
    if single.is_file():
        with _opened(single) as f:
            return dict.fromkeys(f.keys(), single)  # noqa: SIM118 (safe_open is not iterable)
    raise FileNotFoundError(f"no weights in {root}: expected {WEIGHTS_FILE} or {INDEX_FILE}")


#: a numbered layer's tensor: the stack that holds it (``model.layers``), then its index
_LAYER = re.compile(r"^(.*?)\.(\d+)\.")
#: tensors some checkpoints carry that no layer computes with (older transformers saved RoPE's frequencies)
_HARMLESS = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _stored_dtype(files: dict[str, Path], names: dict[str, str]) -> str | None:
    """The dtype the checkpoint's first weight is stored in, read from its file's header (None: unreadable, or not
    one this engine runs)."""
    name = next((n for n in names if n in files), None)
    if name is None:
        return None
    with _opened(files[name]) as f:
        if name not in set(f.keys()):
            return None
        return _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())


@contextmanager
def _opened(file: Path) -> Iterator:
    """A safetensors file opened for reading, or a :class:`CheckpointError` naming it where it cannot be (cut
    short, not safetensors at all)."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
    with handle as f:
        try:
            yield f
        except SafetensorError as exc:
            raise CheckpointError(f"{file} is damaged: {exc}") from None


def load_model(path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> DiffusionLM:
    """Builds the model of a checkpoint directory and fills it with its weights."""
    root = checkpoint_dir(path)
    cls, config = read_config(root)
    names = cls.hf_tensor_names(config)
    files = tensor_files(root)
    # auto: config.json's torch_dtype (transformers' newer ``dtype``), else the stored tensors' (LLaDA-8B-Instruct's
    # config names none: its bfloat16 weights were loaded as float32, twice the memory)
    auto = isinstance(dtype, str) and dtype.lower() == "auto"
    stored = config.raw.get("torch_dtype") or config.raw.get("dtype") or _stored_dtype(files, names) if auto else None
    dtype, device = parse_dtype(dtype, stored), parse_device(device)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} does not run bfloat16; pass --dtype float16 or float32")
    with torch.device("meta"):
        model = cls(config).to(dtype)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = [n for n in names if n not in files]
    if missing:
        raise CheckpointError(f"checkpoint {root} lacks tensor {missing[0]}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(set(files) - set(names))
    modules = {n.rsplit(".", 1)[0] for n in names}
    stacks = {m.group(1) for n in names if (m := _LAYER.match(n))}  # where the numbered layers live
    clashing = [n for n in unexpected if not n.endswith(_HARMLESS) and (
        n.rsplit(".", 1)[0] in modules or ((m := _LAYER.match(n)) is not None and m.group(1) in stacks))]
    if clashing:  # ignoring it would run another model than was saved
        raise CheckpointError(f"checkpoint {root} holds {clashing[0]}"
                              + (f" and {len(clashing) - 1} more" if len(clashing) > 1 else "")
                              + ", a tensor of a layer the config builds without it or of a layer it does not "
                              "build: config.json does not describe these weights (a bias or a norm the config "
                              "leaves out, or more layers than it names)")
    if unexpected:
        logger.warning("ignoring %d tensors the %s model does not use, e.g. %s", len(unexpected),
                       cls.family, unexpected[0])
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():  # every name and shape from the headers, before any memory is taken
        with _opened(file) as f:
            held = set(f.keys())
            for name in file_names:
                if name not in held:
                    raise CheckpointError(f"tensor {name} is listed for {file.name} but is not in it")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != shapes[names[name]]:
                    raise CheckpointError(f"tensor {name} in {file.name} has shape {shape}, the config implies "
                                          f"{shapes[names[name]]}")
    try:
        model.to_empty(device=device)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and not any(
                s in str(exc) for s in ("out of memory", "can't allocate memory")):  # not a device's other faults
            raise
        size = sum(p.numel() * p.element_size() for p in model.parameters())  # still on meta: no memory read
        raise ValueError(f"{root}'s weights need {size / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} on "
                         f"{device}, more than it has free ({type(exc).__name__}); pass a smaller --dtype "
                         "(bfloat16), another device, or a smaller model") from None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file, file_names in by_file.items():
            with _opened(file) as f:
                for name in file_names:
                    params[names[name]].copy_(f.get_tensor(name))
    model.eval()
    model.requires_grad_(False)
    return model
