"""Training rows as users have them, read with HF `datasets` from local files and normalised.

Formats (one per row; `format: auto` reads the row's own fields):

* `messages`: `{"messages": [{"role": "system"|"user"|"assistant", "content": str,
  "reasoning_content"?: str}, ...]}` (OpenAI chat);
* `sharegpt`: `{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}` (also
  `user`/`assistant`), in a JSON array file or JSONL;
* `text`: `{"text": str}`;
* `tokens`: `{"input_ids": [int], "loss_mask": [0|1]}`, already tokenized and masked.

Files are `.json`, `.jsonl` or `.parquet`. A row that does not fit its format raises `ConfigError`
naming the file, the row (0-based) and the field. Every row becomes a `Row` dict with `kind` in
`chat`/`text`/`tokens`, `messages` (role/content/reasoning_content), `text`, `input_ids`,
`loss_mask`, and `origin` (`file:row`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpctoolkit.config.fields import read_text
from hpctoolkit.errors import ConfigError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
CHAT_ROLES = ("system", "user", "assistant")
SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _fail(origin: str, field: str, why: str) -> ConfigError:
    return ConfigError(f"data: {origin}: field {field!r} {why}")


def _messages(raw: Any, origin: str, sharegpt: bool) -> list[dict[str, Any]]:
    name = "conversations" if sharegpt else "messages"
    if not isinstance(raw, list) or not raw:
        raise _fail(origin, name, "must be a non-empty list")
    out = []
    for k, turn in enumerate(raw):
        where = f"{name}[{k}]"
        if not isinstance(turn, dict):
            raise _fail(origin, where, "must be an object")
        role_key, text_key = ("from", "value") if sharegpt else ("role", "content")
        role = turn.get(role_key)
        if sharegpt:
            if role not in SHAREGPT_ROLES:
                raise _fail(
                    origin, f"{where}.{role_key}", f"is {role!r}, expected one of {sorted(SHAREGPT_ROLES)}"
                )
            role = SHAREGPT_ROLES[role]
        elif role not in CHAT_ROLES:
            raise _fail(origin, f"{where}.{role_key}", f"is {role!r}, expected one of {list(CHAT_ROLES)}")
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise _fail(origin, f"{where}.{text_key}", f"must be a string, got {type(content).__name__}")
        reasoning = turn.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise _fail(origin, f"{where}.reasoning_content", "must be a string")
        out.append({"role": role, "content": content, "reasoning_content": reasoning})
    return out


def normalise_row(row: dict[str, Any], fmt: str, origin: str) -> dict[str, Any]:
    """One raw row -> a `Row` dict (see the module docstring); raises naming origin and field."""
    if fmt == "auto":
        present = [
            f
            for f, k in (
                ("messages", "messages"),
                ("sharegpt", "conversations"),
                ("tokens", "input_ids"),
                ("text", "text"),
            )
            if row.get(k) is not None
        ]
        if not present:
            raise _fail(origin, "<row>", "has none of 'messages', 'conversations', 'text', 'input_ids'")
        fmt = present[0]
    out: dict[str, Any] = {
        "kind": "",
        "messages": [],
        "text": "",
        "input_ids": [],
        "loss_mask": [],
        "origin": origin,
    }
    if fmt in ("messages", "sharegpt"):
        key = "messages" if fmt == "messages" else "conversations"
        if key not in row or row[key] is None:
            raise _fail(origin, key, "is missing")
        out["kind"] = "chat"
        out["messages"] = _messages(row[key], origin, fmt == "sharegpt")
    elif fmt == "text":
        if not isinstance(row.get("text"), str) or not row["text"]:
            raise _fail(origin, "text", "must be a non-empty string")
        out["kind"], out["text"] = "text", row["text"]
    elif fmt == "tokens":
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise _fail(origin, "input_ids", "must be a non-empty list of non-negative integers")
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise _fail(origin, "loss_mask", f"must be a list as long as input_ids ({len(ids)})")
        if any(m not in (0, 1) or isinstance(m, bool) for m in mask):
            raise _fail(origin, "loss_mask", "must hold only 0 and 1")
        out["kind"], out["input_ids"], out["loss_mask"] = "tokens", list(ids), list(mask)
    else:
        raise ConfigError(f"data: unknown format {fmt!r}")
    return out


def _first_bad_json_line(path: Path) -> str | None:
    text = read_text(path, "data")  # not UTF-8 or unreadable: one line naming the file
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            return f"is not valid JSON (line {err.lineno}: {err.msg})"
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            return "must hold a JSON array of objects (or be JSONL)"
        return None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            if not isinstance(json.loads(line), dict):
                return f"line {lineno} is not a JSON object"
        except json.JSONDecodeError as err:
            return f"line {lineno} is not valid JSON ({err.msg})"
    return None


def load_rows(path: str | Path, fmt: str = "auto", *, num_proc: int = 1) -> Any:
    """A `datasets.Dataset` of normalised rows of one file (mapped, so cached by datasets)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data: {p} does not exist")
    builder = SUFFIXES.get(p.suffix)
    if builder is None:
        raise ConfigError(f"data: {p} must end in one of {sorted(SUFFIXES)}")
    import datasets

    datasets.disable_progress_bars()
    try:
        raw = datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as err:  # noqa: BLE001  -- datasets and pyarrow raise many types for one bad file
        why = _first_bad_json_line(p) if builder == "json" else None
        if why is not None:
            raise ConfigError(f"data: {p} {why}") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"data: {p} could not be read by datasets ({type(err).__name__}: {first})"
        ) from None
    try:
        return raw.map(
            _normalise_batch,
            with_indices=True,
            fn_kwargs={"fmt": fmt, "file": str(p)},
            remove_columns=raw.column_names,
            num_proc=num_proc if num_proc > 1 and len(raw) > 1 else None,
            batched=True,
            desc=None,
        )
    except UnicodeDecodeError as err:  # pyarrow reads bytes that are not UTF-8; its strings fail late
        if builder == "json":
            read_text(p, "data")  # names the line and byte
        raise ConfigError(f"data: {p} is not UTF-8 text ({err.reason})") from None


def _normalise_batch(
    batch: dict[str, list[Any]], indices: list[int], fmt: str, file: str
) -> dict[str, list[Any]]:
    cols = list(batch)
    out: dict[str, list[Any]] = {
        k: [] for k in ("kind", "messages", "text", "input_ids", "loss_mask", "origin")
    }
    for j, idx in enumerate(indices):
        row = {c: batch[c][j] for c in cols}
        norm = normalise_row(row, fmt, f"{file}: row {idx}")
        for k, col in out.items():
            col.append(norm[k])
    return out
