"""GGUF checkpoints: converted once, through transformers, into a cached HF-style directory.

transformers reads GGUF (dequantizing the weights and rebuilding the tokenizer), which takes
tens of seconds; the converted directory (safetensors, tokenizer, chat template) loads in
seconds afterwards. The cache key includes the file's size and mtime, so a changed file is
converted again.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from asyncengine_kernels import envs

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return envs.cache_dir()


def _cache_dir_for(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{path.stem}-{key[:12]}"


def _save_dequantized(model: object, out: Path) -> None:
    """Write weights and config by hand: transformers refuses to re-serialize GGUF models."""
    from safetensors.torch import save_file

    config = model.config  # type: ignore[attr-defined]
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(str(out))


def convert_gguf(path: str | Path, target: Path | None = None) -> Path:
    """Return an HF directory holding the GGUF's model and tokenizer, converting if needed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file does not exist: {path}")
    target = target or _cache_dir_for(path)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later loads take seconds)", path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        del model
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
