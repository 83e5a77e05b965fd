"""Text <-> token ids through the HF `tokenizers` package, from the copied tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from flashllm.errors import FlashLLMError


class Tokenizer:
    """Encodes like the checkpoint's tokenizer (its own post-processor, plus BOS where configured)."""

    def __init__(self, model_dir: Path, bos_token_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FlashLLMError(f"{path}: missing, so text cannot be encoded; copy tokenizer.json from the "
                                f"original checkpoint into {Path(model_dir)} (or convert a checkpoint that has "
                                f"one), or drive the model with token ids (Model.generate_ids)")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
            raise FlashLLMError(f"{path}: unreadable tokenizer ({exc})") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise FlashLLMError(f"{cfg_path}: unreadable ({exc})") from None
        if not isinstance(cfg, dict):
            raise FlashLLMError(f"{cfg_path}: expected a JSON object, found {type(cfg).__name__}")
        self.bos = bos_token_id if cfg.get("add_bos_token") else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special=False` adds no BOS or post-processor tokens (for text that
        already holds them, such as a rendered chat template)."""
        ids = self.tok.encode(text, add_special_tokens=special).ids
        if special and self.bos is not None and ids[:1] != [self.bos]:
            ids = [self.bos] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
