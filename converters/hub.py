"""`flashllm convert ORG/NAME`: the files a conversion needs, from the Hugging Face Hub into the user's HF cache.

huggingface_hub does the work (snapshot downloads with its progress bars, HF_HOME / HF_HUB_CACHE, HF_TOKEN,
HF_HUB_OFFLINE and an existing cache honoured); this picks the files (config, safetensors or else .bin
weights, tokenizer; or one GGUF file with its split parts) and turns its errors into one line each.
"""

from __future__ import annotations

import re
from pathlib import Path

from flashllm.errors import FlashLLMError
from flashllm.format import manifest as fmt

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
SAFETENSORS = ["config.json", "*.safetensors", "model.safetensors.index.json", *fmt.TOKENIZER_FILES]
PYTORCH_BIN = ["config.json", "pytorch_model*.bin", "pytorch_model.bin.index.json", *fmt.TOKENIZER_FILES]
_SPLIT = re.compile(r"^(?P<prefix>.*)-00001-of-(?P<count>\d{5})\.gguf$")


def is_repo_id(src: str) -> bool:
    """`src` names a Hub repository (ORG/NAME) rather than a path on this machine."""
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def fetch(repo_id: str, revision: str | None = None, gguf_file: str | None = None) -> tuple[Path, dict]:
    """(the local checkpoint directory or GGUF file, the manifest's record of where it came from)."""
    if gguf_file:
        split = _SPLIT.match(gguf_file)
        patterns = [f"{split['prefix']}-*-of-{split['count']}.gguf"] if split else [gguf_file]
        folder = _snapshot(repo_id, revision, patterns)
        path = folder / gguf_file
        if not path.is_file():
            _not_cached(repo_id, revision, gguf_file)
            raise FlashLLMError(f"{repo_id}: no file {gguf_file!r} in the repository{_at(revision)}"
                                f"{_listing(repo_id, revision, '.gguf')}")
    else:
        folder = _snapshot(repo_id, revision, SAFETENSORS)
        if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):
            folder = _snapshot(repo_id, revision, PYTORCH_BIN)  # a checkpoint with .bin weights only
        if not (folder / "config.json").is_file():
            _not_cached(repo_id, revision, "config.json")
            ggufs = _listing(repo_id, revision, ".gguf")
            hint = f"; a GGUF repository: pick a file with --gguf-file NAME{ggufs}" if ggufs else ""
            raise FlashLLMError(f"{repo_id}: no config.json in the repository{_at(revision)} (not a transformers "
                                f"checkpoint){hint}")
        path = folder
    return path, {"repo": repo_id, "revision": folder.name}


def _at(revision: str | None) -> str:
    return f" at revision {revision!r}" if revision else ""


def _not_cached(repo_id: str, revision: str | None, name: str) -> None:
    """Offline, a snapshot in the cache without `name` is a cache miss, not a statement about the repository."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise FlashLLMError(f"{repo_id}{_at(revision)}: {name} is not in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; download it once online")


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """huggingface_hub.snapshot_download of `patterns`, its errors as one line each."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except errors.GatedRepoError:
        raise FlashLLMError(f"{repo_id}: a gated repository; accept its terms on huggingface.co/{repo_id} and log in "
                            f"(hf auth login, or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise FlashLLMError(f"{repo_id}: no such repository on the Hugging Face Hub (or a private one: log in with "
                            f"hf auth login, or set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise FlashLLMError(f"{repo_id}: no revision {revision!r} in the repository") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FlashLLMError(f"{repo_id}{_at(revision)}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                            f"and {why}; download it once online, or give a local directory or .gguf file") from None
    except errors.HfHubHTTPError as exc:
        raise FlashLLMError(f"{repo_id}: download failed ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        raise FlashLLMError(f"{repo_id}: download failed ({exc.strerror or exc})") from None


def _listing(repo_id: str, revision: str | None, suffix: str) -> str:
    """' (files: a, b)' naming the repository's files ending in `suffix` (empty offline or when there are none)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    if constants.HF_HUB_OFFLINE:
        return ""
    try:
        names = [f for f in huggingface_hub.list_repo_files(repo_id, revision=revision) if f.endswith(suffix)]
    except (errors.HfHubHTTPError, OSError, ValueError):
        return ""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f" (files: {shown})" if names else ""
